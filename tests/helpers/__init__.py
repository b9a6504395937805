"""Helpers of the test suite, imported as `from tests.helpers.<module> import <name>`
(pytest.ini puts the repository root on sys.path; no test imports another test module).

    models.py            tiny Hugging Face models and the HF directories they are saved as
    data/pairs.py              tokenized preference pairs (`make_pairs`), packing settings, JSONL files
    reference.py         the independent reference: HF forward + TRL's loss and metric formulas
    parity.py            parity jobs (`jobs_for`, `parity_job`) and their checks (`check_job`)
    moe_parity.py        the same for MoE jobs: expert-parallel shares, the load-balancing loss,
                         routers with a loaded bias (`check_expert_bias_job`: DeepSeek-V3, GLM-4.5)
    lora_parity.py       LoRA jobs (`lora_job`) against Hugging Face + PEFT (`peft_reference`, `check_lora_job`)
    deepseek.py          tiny DeepSeek-V3 models (MLA, YaRN, sigmoid router with bias)
    gemma.py             tiny Gemma 3 text models (local and global layers, sandwich (1 + w) norms)
    glm.py               tiny GLM-4.5 models (partial RoPE, q/k norm, qkv bias, sigmoid router with bias)
    gpt_oss.py           tiny GPT-OSS models (sinks, sliding/full layers, YaRN, biased experts) and MXFP4 experts
    lora_families.py     LoRA jobs of those four families' parity launches, their HF + PEFT reference and checks
    round_trips.py       conversion round trips checked tensor for tensor (`assert_round_trips`), and a
                         quantised copy refused in one line (`assert_quantised_copy_refused`)
    ranks.py             rank spawners: `run_ranks`, `spawn_ranks`, `spawn_processes`, `verify`
    resume_ranks.py      ranks that write training checkpoints as the driver does and resume from them
    megatron_ranks.py    Megatron-LM-style ranks on megatron-core's own APIs (torch_dist tests)
    cli.py               CLI runners: `run_train`, `start_train`, `run_python`, `run`, `start`
    ray_runs.py          the session's Ray cluster and in-process training runs on it
    faults.py            environments that inject faults (tests/fault_hooks) into a run
    host_sync_guard.py   instruments for parity ranks: host reads and messages outside the plan fail
    config_arithmetic.py the arithmetic of configs/'s header comments
    mla_memory.py        what a tiny DeepSeek-V3 stage saves for its backward (multi-latent attention)
    norm_memory.py       what the local spec's norms of a tiny Llama / Qwen3 stage save for their backward
    saved_tensors.py     what autograd saves in a stage's forward, storage by storage, with the module that saved it
    tiers.py             how each test gets its tier (`launches`, read by conftest.py)

Shared set-ups built once per pytest run are fixtures in tests/conftest.py.
"""
