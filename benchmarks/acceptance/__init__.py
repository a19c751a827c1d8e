"""The acceptance run: the product (calibrate, the daemon through short windows, hot-swap into a live
inference server on the same card, a kill mid-night) checked end to end. See run.py."""
