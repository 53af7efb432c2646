"""The lossless wire format, pinned: the encoded bytes of fixed seeded tensors, hashed.

The hashes were taken from the coder before the CPU kernels moved to
locomm/kernels/lossless_cpu.py; any change to the bytes either layout writes
fails here (a new wire version is a new layout, never a change of an old one).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from locomm.compression.lossless import LosslessCodec


def _tensors() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(1234)
    g = torch.from_numpy(rng.standard_normal(300_001).astype(np.float32)) * 0.02
    relu = torch.from_numpy(np.maximum(rng.standard_normal(70_000), 0).astype(np.float32))
    spiky = torch.from_numpy(rng.standard_normal(50_000).astype(np.float32))
    spiky[::97] = float("inf")
    spiky[1::89] = float("nan")
    spiky[2::13] = 0.0
    return {
        "gauss-bf16": g.bfloat16(),
        "gauss-fp16": g.half(),
        "gauss-fp32": g,
        "relu-bf16": relu.bfloat16(),
        "spiky-bf16": spiky.bfloat16(),
        "spiky-fp32": spiky,
        "zeros-bf16": torch.zeros(5000, dtype=torch.bfloat16),
        "uniform-bits-bf16": torch.from_numpy(rng.integers(0, 1 << 16, 40_000, dtype=np.uint16).view(np.int16)).view(
            torch.bfloat16
        ),
        "tiny-bf16": g[:7].bfloat16(),
        "empty-bf16": torch.zeros(0, dtype=torch.bfloat16),
    }


CODECS = {
    "v1": dict(layout="lanes", chunk_elems=1 << 16),
    "v2": dict(layout="segments", chunk_elems=1 << 16),
    "v2-lane100": dict(layout="segments", chunk_elems=50_000, lane_syms=100),
    "v1-empirical": dict(layout="lanes", chunk_elems=1 << 15, table="empirical"),
    "v2-empirical": dict(layout="segments", chunk_elems=1 << 15, table="empirical"),
    "v1-default": dict(layout="lanes"),
    "v2-default": dict(layout="segments"),
}

PINNED = {
    "v1": {
        "empty-bf16": "a4239a9def719a28a2c229c4ab7b9a6f",
        "gauss-bf16": "d9a0f301d8d79602627ea321d3468428",
        "gauss-fp16": "8bffef38a9b644ee53d2962335612b0c",
        "gauss-fp32": "f7a0a612fee2f267b7ac8aef437965c3",
        "relu-bf16": "317ab1a327348d1093b235d924a165ec",
        "spiky-bf16": "d6a363ea6cac5e2b7e0ebe8c3ce28f6a",
        "spiky-fp32": "a4589e61fb35b9c4204377d0a31b4081",
        "tiny-bf16": "d7458474c95e14bd556d72f116327488",
        "uniform-bits-bf16": "991e9f9e8b7348e53497c47c78dc386e",
        "zeros-bf16": "2e70726dd32b194cdbb9ae343a606e60",
    },
    "v1-default": {
        "empty-bf16": "f604859af2d2cced2caba8327e806d32",
        "gauss-bf16": "faef1a21082e7f38c8af7d3162b5ce26",
        "gauss-fp16": "a898a673ef4b06b0d41100c1fb7918c0",
        "gauss-fp32": "e7689f19e0f76e78a61ee0990af8d135",
        "relu-bf16": "8529e17057b1afce7b06f1f10ec270bc",
        "spiky-bf16": "ebaeb0f7105180106704bac4da3f6f38",
        "spiky-fp32": "d83ec53b208e0ed4c186cf6eb90130d0",
        "tiny-bf16": "6f8c6ba7d7a81bd0ecd6dfce68cf283d",
        "uniform-bits-bf16": "22e876a1fa0553b46913e1933b94212b",
        "zeros-bf16": "d421ff31370ee0c70db036771e86aea7",
    },
    "v1-empirical": {
        "empty-bf16": "db81133c3bbd632ef22d44222424ec70",
        "gauss-bf16": "60cba0c04a1f83e9dc9044813ca8b6be",
        "gauss-fp16": "1e6ef74ecbb6198fff89785768759113",
        "gauss-fp32": "0a6dd3fbe65771e30c08272f3261bb16",
        "relu-bf16": "4d63af2fe3855a59448d1cb4157c10a0",
        "spiky-bf16": "a079959054f699079f46be36eec1521f",
        "spiky-fp32": "244ffc614dfe6dca081f632c6591022d",
        "tiny-bf16": "df0b579752d2b260bf22e1339e6bb324",
        "uniform-bits-bf16": "2635752d75518195924710d3005bda28",
        "zeros-bf16": "fc67b0da97478016ef39d3e4a9f5f68f",
    },
    "v2": {
        "empty-bf16": "d1fc3a96c0f7edc3331974241446bcac",
        "gauss-bf16": "9a77fdcd5f24d4c5475d8c9a945aa780",
        "gauss-fp16": "158dd6b6ca0b6db888829b724c78f179",
        "gauss-fp32": "8fd6a615d37485c22e9eb56525ef88cc",
        "relu-bf16": "139ea686d7fd975c8bba2cd4a73e0348",
        "spiky-bf16": "60127f113a38c9d633f10caf65ff9692",
        "spiky-fp32": "7bbef46f346dcd9110b27341aadb16cb",
        "tiny-bf16": "cf8f418ad03f810c214fc016bc770bc6",
        "uniform-bits-bf16": "784a0bd4c67c1868473d8612dd6db537",
        "zeros-bf16": "7b578e18f7cb58c3e3ee6784ecd50a49",
    },
    "v2-default": {
        "empty-bf16": "d7730b9601aa7afe6f4e0592bc8b30a1",
        "gauss-bf16": "1103a12c69f11eb52cb2df34c162ec19",
        "gauss-fp16": "69e68f1b3e92c1639f35bbc15cfc8f5e",
        "gauss-fp32": "b0d199989124f79e7d9fc09ec99f2833",
        "relu-bf16": "80cee7706f782fd7419b41c17139a1cd",
        "spiky-bf16": "12f1cb3a75b4179a91dcebda8b3ba311",
        "spiky-fp32": "55244ab2ac6671943e96c8de935ea8a3",
        "tiny-bf16": "f8b22e77a0f6b5daca2b1eed39a79ac6",
        "uniform-bits-bf16": "00a6ec3464fc9200d879ccc973572d82",
        "zeros-bf16": "dc147f994344a90bab921bbc4607dfd9",
    },
    "v2-empirical": {
        "empty-bf16": "31372c11052e2f14463a0a534631418f",
        "gauss-bf16": "fee0037c50845777bdcb600eb3b3458e",
        "gauss-fp16": "e5aa641b4b27b28116321063ef799131",
        "gauss-fp32": "64f20244266af6b804a22d95a207cdab",
        "relu-bf16": "4f393a1f30503496499da27bb509215b",
        "spiky-bf16": "8e53113d503933225025e44fc348c977",
        "spiky-fp32": "18d109ea827b9c5a8681d73439243b75",
        "tiny-bf16": "5c366850442a7560fcb758e36ca21c1c",
        "uniform-bits-bf16": "2e1520e829a373b3d3173a1276f998e1",
        "zeros-bf16": "07f30c08904b6b0c49afce3a14c3ab63",
    },
    "v2-lane100": {
        "empty-bf16": "b27e62a0e471f00c8ecd90aa28d6e5f7",
        "gauss-bf16": "414d5fba8724d6c30e964513969481df",
        "gauss-fp16": "bf37ea1c55e4622cf62fc1fba8dadbdc",
        "gauss-fp32": "d75968377e2ed897a25021b6c28953a5",
        "relu-bf16": "0c9e1452b128374f075dc04e189d4e69",
        "spiky-bf16": "95be92941fa64329e6380da74005acfb",
        "spiky-fp32": "83f0366aad5b3717d804db7609ab23d7",
        "tiny-bf16": "28e76aaa25f842f2939d65221fda4049",
        "uniform-bits-bf16": "5d8a46e3a1929a2b0ba2d915564647b4",
        "zeros-bf16": "9636e9a555bb4e6ccc57dd24832db55a",
    },
}


def _digest(codec: str, name: str) -> str:
    x = _tensors()[name]
    data = LosslessCodec(impl="cpu", **CODECS[codec]).encode(x)
    return hashlib.sha256(data).hexdigest()[:32]


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_encoded_bytes_are_pinned(codec: str) -> None:
    tensors = _tensors()
    for name, x in tensors.items():
        c = LosslessCodec(impl="cpu", **CODECS[codec])
        data = c.encode(x)
        assert hashlib.sha256(data).hexdigest()[:32] == PINNED[codec][name], (codec, name)
        y = c.decode(data)
        assert y.dtype == x.dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8)), (codec, name)
