"""fp8mla: FP8 Multi-head Latent Attention decoding for NVIDIA Hopper, in Triton and Gluon."""
from .api import flash_mla_with_kvcache, get_mla_metadata, hopper_available, write_kv_cache
from .formats import KV_FORMATS, dequantize_kv_cache, empty_kv_cache, quantize_fp8_per_tensor, quantize_kv_cache
from .kernels import BACKENDS
from .reference import cal_diff, reference_mla_decode, reference_sparse_mla_decode

__version__ = "0.1.0"
__all__ = ["BACKENDS", "KV_FORMATS", "cal_diff", "dequantize_kv_cache", "empty_kv_cache", "flash_mla_with_kvcache",
           "get_mla_metadata", "hopper_available", "quantize_fp8_per_tensor", "quantize_kv_cache",
           "reference_mla_decode", "reference_sparse_mla_decode", "write_kv_cache"]
