"""Training one night's adapter. At the top, the core path: config, load, the loop and its step, packing,
the step shape, calibration's probe, checkpoints, save. In wings: fp8/ (the frozen base on FP8), moe/
(mixture-of-experts bases), ranks/ (several processes), models/ (random-initialised stand-ins, the demo model)."""
