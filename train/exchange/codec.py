"""How a tensor crosses BASE_DIR: the codecs of the exchange (pseudo-gradients one way, outer updates the other).

A codec turns one float32 tensor into the tensors stored for it in a safetensors file and back:

    none / float32   the tensor itself (4 bytes / value)
    bfloat16, float16 a cast (2 bytes / value)
    int8             block-wise absmax: per block of `block` values one float32 scale s = max|x| / 127 and int8
                     codes round(x / s) in [-127, 127]           (1 + 4/block bytes / value)
    int4             the same with codes in [-7, 7], two per byte  (0.5 + 4/block bytes / value)

Stored names: `<name>` holds the codes (flat for int8/int4, the tensor's shape for casts) and `<name>::scale` the
float32 scales. The file's metadata declares `codec` and `block`, and the reader refuses a file whose header does not
match what the declared codec produces for the global model's shapes (a wrong block size, truncated codes, a missing
scale) or whose scales are not finite and >= 0 — before any tensor reaches θ.

Error bound (round to nearest): |x − decode(encode(x))| <= s / 2 = max|x over the block| / (2 · qmax) per value.
Why absmax per block, not one scale per tensor: a pseudo-gradient has outlier rows (embeddings of frequent tokens,
norm gains); a per-tensor scale spends the code range on them and rounds most values to 0. Measured on real
pseudo-gradients (bench/compression.py): int8 0.45% relative error at block 128 vs 0.73% per tensor, int4 8.3% vs
13.3%; the default 128 (scale overhead 3%) is what keeps int8 under 15% of the fp32 protocol's bytes.

Decoding is `codes.float() * scale` (one IEEE multiply per value, the same on every device), so every process that
decodes the same file gets the same bits — what keeps every copy of θ identical (train/exchange/theta.py).

Error feedback (`Residual`): a sender keeps what the codec lost and adds it to its next message, so the sum of what
was sent tracks the sum of what was meant to be sent (it never drifts by more than one quantisation error).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

CODECS = ("none", "float32", "bfloat16", "float16", "int8", "int4")
SCALE = "::scale"


class CodecError(ValueError):
    """A stored tensor does not match its declared codec (the message says what is wrong)."""


@dataclass(frozen=True)
class Codec:
    name: str            # one of CODECS ("none" is float32)
    block: int = 128     # values per scale (int8 / int4)

    # -- what is stored ----------------------------------------------------------------------------------------------
    @property
    def quantised(self) -> bool:
        return self.name in ("int8", "int4")

    @property
    def lossless(self) -> bool:
        return self.name in ("none", "float32")

    @property
    def qmax(self) -> int:
        return {"int8": 127, "int4": 7}[self.name]

    def metadata(self) -> dict[str, str]:
        return {"codec": self.name, "block": str(self.block)}

    def specs(self, name: str, shape: tuple) -> dict[str, tuple[torch.dtype, tuple]]:
        """{stored name: (dtype, shape)} for a tensor `name` of `shape`, in file order."""
        shape = tuple(shape)
        if not self.quantised:
            return {name: ({"none": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                            "float16": torch.float16}[self.name], shape)}
        n = math.prod(shape)
        nb = -(-n // self.block)
        codes = (n,) if self.name == "int8" else ((n + 1) // 2,)
        return {name: (torch.int8 if self.name == "int8" else torch.uint8, codes),
                name + SCALE: (torch.float32, (nb,))}

    def bytes_per_value(self) -> float:
        if not self.quantised:
            return {"none": 4, "float32": 4, "bfloat16": 2, "float16": 2}[self.name]
        return (1.0 if self.name == "int8" else 0.5) + 4.0 / self.block

    # -- encode / decode ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stored tensors for float32 `x` (CPU or GPU; results on x's device)."""
        if not self.quantised:
            dtype, _ = self.specs(name, tuple(x.shape))[name]
            return {name: x.to(dtype).contiguous()}
        flat = x.reshape(-1).to(torch.float32)
        n, B = flat.numel(), self.block
        nb = -(-n // B)
        padded = torch.nn.functional.pad(flat, (0, nb * B - n)).view(nb, B)
        scale = padded.abs().amax(dim=1) / self.qmax
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = torch.round(padded * inv.unsqueeze(1)).clamp_(-self.qmax, self.qmax)
        codes = codes.reshape(-1)[:n].to(torch.int8)
        if self.name == "int4":
            codes = pack_int4(codes)
        return {name: codes, name + SCALE: scale}

    @torch.no_grad()
    def decode(self, name: str, stored: Mapping[str, torch.Tensor], shape: tuple) -> torch.Tensor:
        """float32 tensor of `shape` from the stored tensors (bit-identical on every device)."""
        if not self.quantised:
            return stored[name].to(torch.float32).reshape(shape)
        n = math.prod(shape)
        codes = stored[name]
        if self.name == "int4":
            codes = unpack_int4(codes, n)
        scale = stored[name + SCALE].to(torch.float32)
        B = self.block
        nb = scale.numel()
        vals = torch.nn.functional.pad(codes.to(torch.float32), (0, nb * B - n)).view(nb, B)
        return (vals * scale.unsqueeze(1)).reshape(-1)[:n].reshape(shape)

    @torch.no_grad()
    def round_trip(self, name: str, v: torch.Tensor, buf: torch.Tensor | None = None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(encode(name, v), decode of it) for a flat float32 piece `v` — the same bits as encode then decode
        (tests/unit/test_codec.py) in fewer passes and no padded copies: the block's absmax from |x| in the buffer,
        the codes rounded in a float32 buffer (`buf`, at least v.numel() values rounded up to a block: reused, no
        fresh pages), then the codes put back into it as floats and multiplied by the scales in place (decode's
        codes.float() · scale). The decoded values are a view of `buf`. A cast codec: encode and decode as they
        are. A block codec's piece holds whole blocks but for its last (the caller cuts a tensor on block
        boundaries)."""
        if not self.quantised:
            stored = self.encode(name, v)
            return stored, self.decode(name, stored, tuple(v.shape))
        n, B, q = v.numel(), self.block, self.qmax
        nb = -(-n // B)
        if buf is None:
            buf = torch.empty(nb * B, dtype=torch.float32, device=v.device)
        out = buf[:nb * B].view(nb, B)
        full = n // B
        vals = out[:full]
        if n % B:  # the last block, short: padded with zeros as encode() pads it
            out[full].zero_()
            out[full, :n - full * B].copy_(v[full * B:])
        # encode()'s abs().amax(dim=1), the |x| put in the buffer the codes overwrite next (a reduction along the
        # block is 8x faster over |x| than torch.aminmax's min/max pair; the same op as encode, so the same bits,
        # NaN included)
        absmax = torch.abs(v[:full * B], out=vals.view(-1)).view(full, B).amax(dim=1)
        if n % B:
            absmax = torch.cat([absmax, out[full].abs().amax().reshape(1)])
        scale = absmax.div_(q)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        torch.mul(v[:full * B].view(full, B), inv[:full].unsqueeze(1), out=vals)
        if n % B:
            out[full].mul_(inv[full])
        out.round_().clamp_(-q, q)
        codes = out.view(-1)[:n].to(torch.int8)
        out.view(-1)[:n].copy_(codes)  # decode's codes.float(): −0.0 and a NaN of 0 · inf (a scale so small that its
        # inverse overflows) are what their int8 code says, as decode() sees them
        seen = out.mul_(scale.unsqueeze(1)).view(-1)[:n]
        if self.name == "int4":
            codes = pack_int4(codes)
        return {name: codes, name + SCALE: scale}, seen

    @torch.no_grad()
    def decode_range(self, name: str, stored: Mapping[str, torch.Tensor], n: int, i: int, j: int,
                     buf: torch.Tensor | None = None) -> torch.Tensor:
        """Values i..j of decode(name, stored, (n,)) (flat float32; `i` on a block boundary), into `buf` (float32,
        at least j − i values rounded up to a block) when given: the same products codes.float() · scale as
        decode(), without a tensor-sized temporary. int4's codes are unpacked for the range only (two per byte:
        `i` is even as a block boundary)."""
        if not self.quantised:
            return stored[name].reshape(-1)[i:j].to(torch.float32)
        B = self.block
        b0, b1 = i // B, -(-j // B)
        codes = stored[name]
        if self.name == "int4":
            codes = unpack_int4(codes[i // 2:(j + 1) // 2], j - i)
        else:
            codes = codes[i:j]
        m = j - i
        out = torch.empty((b1 - b0) * B, dtype=torch.float32) if buf is None else buf[:(b1 - b0) * B]
        out[:m].copy_(codes)
        if m < out.numel():  # a short last block (its padding decodes to nothing that is returned)
            out[m:].zero_()
        scale = stored[name + SCALE][b0:b1].to(torch.float32)
        return out.view(b1 - b0, B).mul_(scale.unsqueeze(1)).view(-1)[:m]

    # -- checking a file written by someone else -----------------------------------------------------------------------
    def check_header(self, header: Mapping[str, dict], expect_shapes: Mapping[str, tuple], metadata: Mapping[str, str],
                     ) -> None:
        """Raise CodecError unless `header` (a safetensors header) is exactly what this codec stores for
        `expect_shapes` and the metadata declares this codec and block size."""
        from train.core.tensorio import _DTYPES

        declared = metadata.get("codec")
        if declared is None and self.quantised:
            raise CodecError(f"the file does not declare its codec (expected {self.name})")
        declared = declared or self.name  # a plain cast is self-describing (files of earlier writers)
        if declared != self.name and not ({declared, self.name} <= {"none", "float32"}):
            raise CodecError(f"the file declares codec {declared!r}, the run uses {self.name!r}")
        if self.quantised and metadata.get("block") != str(self.block):
            raise CodecError(f"the file declares block size {metadata.get('block')}, the run uses {self.block}")
        want: dict[str, tuple] = {}
        for n, s in expect_shapes.items():
            want.update(self.specs(n, tuple(s)))
        if set(header) != set(want):
            diff = sorted(set(header) ^ set(want))
            raise CodecError(f"tensor names differ from the global model's (e.g. {diff[:3]})")
        what = f"the {self.name} codec" + (f" with block {self.block}" if self.quantised else "")
        for k, (dtype, shape) in want.items():
            info = header[k]
            if tuple(info["shape"]) != tuple(shape):
                raise CodecError(f"{k}: shape {info['shape']}, {what} stores {list(shape)} for the global model"
                                 + ("" if self.quantised else f" (it has {list(shape)})"))
            if info["dtype"] != _DTYPES[dtype]:
                raise CodecError(f"{k}: dtype {info['dtype']}, expected {_DTYPES[dtype]} ({what})")

    def check_values(self, name: str, stored: Mapping[str, torch.Tensor], shape: tuple | None = None) -> None:
        """Scales must be finite and >= 0; int8 codes within [-qmax, qmax]; cast values finite."""
        if self.quantised:
            s = stored[name + SCALE]
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise CodecError(f"{name}: scales are not finite and >= 0 (NaN/inf or negative)")
            codes = stored[name]  # its least code, in one pass that makes no mask of the codes' size
            if self.name == "int8" and codes.numel() and int(codes.min()) == -128:
                raise CodecError(f"{name}: int8 code -128 is outside [-127, 127]")
        elif not all_finite(stored[name]):
            raise CodecError(f"{name}: non-finite values (NaN/inf)")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite, in one pass that allocates nothing of t's size (isfinite().all()
    writes a mask of it first: 3x the time on a 135M-value delta): its least and greatest values are finite exactly
    when every value is (torch.aminmax returns NaN for both when any value is NaN, and an infinity is the least or
    the greatest). 0.02-0.04 s for 135M float32 values on this box's 2 cores, where a float64 sum took 0.5-0.6 s:
    torch.sum(dtype=float64) converts the whole tensor first."""
    if t.numel() == 0:
        return True
    if t.is_floating_point():
        lo, hi = torch.aminmax(t.reshape(-1))
        return math.isfinite(float(lo)) and math.isfinite(float(hi))
    return True  # integer codes are always finite


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two per byte (low nibble first), offset by 8."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    u = u.view(-1, 2)
    return (u[:, 0] | (u[:, 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    lo = (packed & 0x0F).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)[:n].to(torch.int8)


def get_codec(name: str, block: int = 128) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: one of {', '.join(CODECS)}")
    return Codec("none" if name == "float32" else name, block)


class Residual:
    """Error feedback for one sender: `send(name, x)` returns what to store for x + (what was lost last time, times
    the codec's `ef_decay` β when it has one) and
    keeps the new loss. `tensors()` / `load()` make it part of the sender's resume state.

    `undo`: the error as it was before the last send is kept too (one more model-sized buffer, no copy: the tensor
    the send replaces), so `take_back()` can undo a send the receivers never took (its delta was rejected). It is
    not part of the resume state (a worker's snapshot every round would grow by a model's size for a rare event): a
    sender restarted right after such a send carries its error as before."""

    def __init__(self, codec: Codec, undo: bool = False):
        self.codec = codec
        self.error: dict[str, torch.Tensor] = {}
        self.undo = undo
        self.before: dict[str, torch.Tensor | None] = {}  # (None: nothing was carried before that send)
        # β of SparseLoCo's error feedback (train/exchange/sparse.py): e is decayed before it joins the next
        # message; 1 (every dense codec) carries it whole
        self.decay = float(getattr(codec, "ef_decay", 1.0))

    @torch.no_grad()
    def send(self, name: str, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(stored tensors, the decoded value the receivers will see) for float32 `x` plus the carried error."""
        v = x.to(torch.float32)
        e = self.error.get(name)
        if e is not None:
            v = v + (e if self.decay == 1.0 else e * self.decay).to(v.device)
        if isinstance(self.codec, Codec) and self.codec.quantised:  # encode + decode in one round trip (fewer passes)
            stored, seen = self.codec.round_trip(name, v.reshape(-1))
            seen = seen.reshape(v.shape)
        else:
            stored = self.codec.encode(name, v)
            seen = self.codec.decode(name, stored, tuple(v.shape))
        if not self.codec.lossless:
            if self.undo:
                self.before[name] = e
            self.error[name] = (v - seen).to("cpu")
        return stored, seen

    def take_back(self) -> bool:
        """Undo the last send of every tensor: the error is what it was before it. For a delta the coordinator
        rejected (the screen: a diverged model, a corrupted update): the receivers took none of it, and what it
        left to carry came from it — with topk most of it, which the next deltas would bring back (bench/soak.py
        --codec topk: a ×100 delta kept its worker's next 13 deltas 6-15× the round's median norm). False when
        there is nothing to take back (no send since the last take_back or since a restart)."""
        if not self.before:
            return False
        self.error = {k: e for k, e in self.before.items() if e is not None}
        self.before = {}
        return True

    def tensors(self, prefix: str = "residual::") -> dict[str, torch.Tensor]:
        return {prefix + k: v for k, v in self.error.items()}

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str = "residual::") -> None:
        self.error = {k[len(prefix):]: v.to(torch.float32).clone() for k, v in tensors.items()
                      if k.startswith(prefix)}
        self.before = {}
