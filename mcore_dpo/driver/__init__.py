"""The driver: the process `python -m mcore_dpo.train` starts. It prepares and checks a run, owns its output directory, starts the Ray worker groups and feeds them steps."""
