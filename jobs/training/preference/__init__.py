"""The preference (DPO) objective: its training loop and checkpoints (`dpo`), and the steps calibrate times
(`probe`)."""
