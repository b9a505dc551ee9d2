"""The paper's method, readable alone: RoPE, caches, moments, calibration, selection, ridge, the mapper
artifact kinds, transfer, models, io. Imports nothing from the rest of kvtransfer but kvtransfer.config."""
