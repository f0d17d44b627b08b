"""DeepSeek-V4.1 (text): the model DeepSeek's own engine serves (``family.py``)."""
