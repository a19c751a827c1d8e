"""The card seen through NVML: telemetry of the night's child (power, energy, memory, utilisation) on
one card or several."""
