from deepinfer.ops.norm.torch_ref import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq

__all__ = ["apply_rope", "rms_norm", "rope_cos_sin", "rope_inv_freq"]
