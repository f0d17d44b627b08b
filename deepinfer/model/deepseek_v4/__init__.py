"""DeepSeek-V4: one model family (``family.py`` lists its rooms). Importing the package loads
nothing: ``args`` is torch-free, the rest is imported where it is used."""
