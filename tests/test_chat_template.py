"""--chat-template FILE through the real command line: conversational rows train with a tokenizer
that has no template of its own, exactly as with a tokenizer that ships the same template; without
the flag the error points to it; a template that does not render is one line naming the file."""

from __future__ import annotations

import json
import shutil

import pytest

from mcore_dpo.driver import defaults, outputs, run
from mcore_dpo.command_line import resolve
from mcore_dpo.train import main

ROWS = [
    {"prompt": [{"role": "user", "content": f"name {n} animals ."}],
     "chosen": [{"role": "assistant", "content": f"sure : {n} sheep ."}],
     "rejected": [{"role": "assistant", "content": f"sure : {n} hammers ."}]}
    for n in ("two", "three", "four", "five")
]


@pytest.fixture
def setup(tmp_path):
    """A copy of the default tokenizer without its chat_template.jinja, the template as a file of
    its own, and conversational rows."""
    bare = tmp_path / "tokenizer-without-template"
    shutil.copytree(defaults.DEFAULT_TOKENIZER_DIR, bare)
    (bare / "chat_template.jinja").unlink()
    template = tmp_path / "my-template.jinja"
    shutil.copy(f"{defaults.DEFAULT_TOKENIZER_DIR}/chat_template.jinja", template)
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    argv = ["--model", defaults.ensure_default_model(), "--data", str(data), "--global-batch-size", "2",
            "--micro-batch-size", "1"]
    return bare, template, data, argv


def test_chat_template_makes_conversational_rows_work_with_a_tokenizer_without_one(setup):
    bare, template, _, argv = setup
    config, _ = resolve([*argv, "--tokenizer", str(bare), "--chat-template", str(template)])
    assert config.chat_template == str(template)
    with_flag = list(run.prepare(config).train_data)
    shipped = list(run.prepare(resolve([*argv, "--tokenizer", defaults.DEFAULT_TOKENIZER_DIR])[0]).train_data)
    assert len(with_flag) == len(ROWS)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in with_flag] == \
        [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in shipped]


def test_without_a_template_the_error_points_to_the_flag(setup, capsys):
    bare, _, data, argv = setup
    assert main([*argv, "--tokenizer", str(bare)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{data}:1:" in err and "--chat-template FILE" in err, err


def test_a_template_that_does_not_render_is_one_line(setup, tmp_path, capsys):
    bare, _, _, argv = setup
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}")  # no endfor
    assert main([*argv, "--tokenizer", str(bare), "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: chat_template: {broken} does not render"), err
    assert main([*argv, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "chat_template:" in capsys.readouterr().err


def test_the_template_is_kept_with_the_run_and_travels_with_the_weights(setup, tmp_path, monkeypatch):
    from mcore_dpo.driver import ray_workers

    bare, template, _, argv = setup
    monkeypatch.setattr(ray_workers, "connect", lambda **_: False)
    monkeypatch.setattr(ray_workers, "disconnect", lambda started: None)
    seen = []
    monkeypatch.setattr(run, "_attempt", lambda prep, *, out, log: seen.append(prep))
    out = tmp_path / "run"
    assert main([*argv, "--tokenizer", str(bare), "--chat-template", str(template), "--output-dir", str(out),
                 "--max-steps", "1"]) == 0
    assert (out / "chat_template.jinja").read_text() == template.read_text()
    (prep,) = seen
    _, aux = outputs.model_meta(prep.config, prep.spec, dtype="float32", layer_spec="local")
    templates = [p for p in aux if p.name == "chat_template.jinja"]
    assert templates == [out / "chat_template.jinja"]  # what checkpoints and hf/ carry


def test_a_resume_with_another_template_is_named_as_a_change(setup):
    from mcore_dpo.driver.resume_check import changes, run_identity

    bare, template, _, argv = setup
    config, _ = resolve([*argv, "--tokenizer", str(bare), "--chat-template", str(template)])
    before = run_identity(config)
    assert changes(before, run_identity(config)) == []
    template.write_text(template.read_text() + "{# another template #}")
    assert changes(before, run_identity(config)) == ["--chat-template (its content) changed"]
