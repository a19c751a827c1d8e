"""The GPU backend: Unsloth's loading and import, and what PEFT needs beside it (GPU-only imports stay inside
functions, so a CPU machine imports every module)."""
