"""The capture path: an OpenAI-compatible pass-through in front of the inference server that records what was
asked and answered, takes feedback on a reply, and leaves preference or supervised records in an inbox."""
