"""Compile the lossless codec's numba kernels at image build time, into $NUMBA_CACHE_DIR.

Each peer would otherwise spend ~10 s of CPU compiling them at start (the cache is per machine and CPU;
a container on another CPU model compiles again, into the same writable folder).
"""

import torch

from locomm.compression import get_codec

codec = get_codec("lossless")
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = torch.linspace(-1, 1, 4096).to(dtype)
    assert torch.equal(codec.decode(codec.encode(x)), x), dtype
print("numba kernels compiled")
