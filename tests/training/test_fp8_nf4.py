"""FP8 bases kept in NF4 (issue 16's storage choice), CPU side: bitsandbytes' layout read right, the e4m3 values
exactly those of an e4m3 copy (forward and transposed), the Functions unchanged by the storage, the conversion's
switch and its memory accounting, the config key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jobs.training.config import TrainConfig
from jobs.training.fp8.matmul import E4M3, FP8Base, FP8Group, transpose_cat
from jobs.training.fp8.nf4 import NF4Source
from jobs.training.fp8.selftest import check_kind, verdict

# bitsandbytes' NF4 code (functional.get_4bit_type("nf4"))
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def quantize_nf4(w: torch.Tensor, blocksize: int = 64, nested: bool = False):
    """A test quantiser writing bitsandbytes' layout: (NF4Source, the codes [N*K], the fp32 absmax a block)."""
    flat = w.float().reshape(-1)
    absmax = flat.view(-1, blocksize).abs().amax(1).clamp(min=1e-12)
    normed = (flat.view(-1, blocksize) / absmax[:, None]).reshape(-1)
    idx = (normed[:, None] - NF4[None, :]).abs().argmin(1).to(torch.uint8)
    packed = ((idx[0::2] << 4) | idx[1::2]).view(-1, 1)  # the even-indexed value in the high nibble
    if not nested:
        return NF4Source(packed, absmax, NF4, blocksize, tuple(w.shape)), idx, absmax
    offset = float(absmax.mean())
    centred = absmax - offset
    code2, b2 = torch.linspace(-1, 1, 256), 256
    padded = torch.cat([centred, centred.new_zeros((-centred.numel()) % b2)]).view(-1, b2)
    absmax2 = padded.abs().amax(1).clamp(min=1e-12)
    q = ((padded / absmax2[:, None]).reshape(-1)[: centred.numel(), None] - code2[None, :]).abs().argmin(1)
    q = q.to(torch.uint8)
    used = code2[q.long()] * absmax2.repeat_interleave(b2)[: q.numel()] + offset
    return NF4Source(packed, q, NF4, blocksize, tuple(w.shape), (absmax2, code2, b2, offset)), idx, used


@pytest.mark.parametrize("nested", [False, True])
def test_the_packed_bytes_are_read_as_bitsandbytes_writes_them(nested):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.02
    src, idx, absmax = quantize_nf4(w, nested=nested)
    want = (NF4[idx.long()] * absmax.repeat_interleave(64)).to(torch.bfloat16).view(48, 128)
    assert torch.equal(src.dequantized(), want)
    assert torch.equal(src.absmax_f32(), absmax)
    assert (src.dequantized().float() - w).norm() / w.norm() < 0.12  # NF4's own error: the layout is right


@pytest.mark.parametrize("nested", [False, True])
def test_an_nf4_base_gives_exactly_the_e4m3_copys_values_forward_and_transposed(nested):
    torch.manual_seed(1)
    srcs = [quantize_nf4(torch.randn(n, 64) * 0.02, nested=nested)[0] for n in (64, 32, 32)]
    dense = [s.dequantized() for s in srcs]
    copies = [FP8Base.from_weight(d) for d in dense]
    kept = [FP8Base.from_nf4(s, d) for s, d in zip(srcs, dense, strict=True)]
    for c, k in zip(copies, kept, strict=True):
        assert k.weight is None and k.nf4 is not None
        assert torch.equal(k.weight_scale, c.weight_scale)
        assert torch.equal(k.fp8_weight().view(torch.uint8), c.weight.view(torch.uint8))
    want = transpose_cat([c.weight for c in copies]).view(torch.uint8)
    assert torch.equal(FP8Group(kept, keep_transposed=False).transposed().view(torch.uint8), want)
    mixed = FP8Group([copies[0], kept[1], copies[2]], keep_transposed=True)  # per base, into its columns
    assert mixed.weight_t is not None and mixed.weight_t.dtype == E4M3
    assert torch.equal(mixed.transposed().view(torch.uint8), want)


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)]),
    ("o", [(64, 128)]),
    ("mlp", [(128, 64), (128, 64), (64, 128)]),
    ("linear", [(48, 64)]),
])
def test_the_functions_on_nf4_bases_compute_what_they_do_on_e4m3_copies(kind, shapes, monkeypatch):
    def quantiser(w):
        src, _, _ = quantize_nf4(w.cpu())
        return src, src.dequantized()

    kept = check_kind(kind, shapes, device="cpu", tokens=48, nf4=quantiser)
    assert verdict(kind, kept) is None, kept
    assert kept["dx"] > 0.005  # FP8 ran
    monkeypatch.setattr(FP8Base, "from_nf4", classmethod(lambda cls, src, w, bias=None: cls.from_weight(w, bias)))
    assert check_kind(kind, shapes, device="cpu", tokens=48, nf4=quantiser) == kept  # the same weights as copies


class Nf4Linear(torch.nn.Linear):
    """A Linear4bit's shape: packed bytes with a quant_state on the weight; `src` the test's own NF4Source."""

    def __init__(self, n, k):
        super().__init__(k, n, bias=False)
        self.src, _, _ = quantize_nf4(torch.randn(n, k) * 0.02, nested=True)
        weight = torch.nn.Parameter(self.src.packed.view(-1, 1), requires_grad=False)
        state2 = SimpleNamespace(absmax=self.src.absmax2, code=self.src.code2, blocksize=256)
        weight.quant_state = SimpleNamespace(quant_type="nf4", shape=torch.Size([n, k]), absmax=self.src.absmax,
                                             code=self.src.code, blocksize=64, nested=True, offset=self.src.offset,
                                             dtype=torch.bfloat16, state2=state2)
        self.weight = weight


def test_the_conversion_keeps_nf4_bases_in_nf4_and_accounts_for_them(monkeypatch):
    from jobs.training.fp8 import convert as fp8_convert
    from jobs.training.fp8.convert import Conversion, Unit, base_bytes

    torch.manual_seed(2)

    def dense(base):  # bitsandbytes' dequantisation, here from the test's own source
        return base.src.dequantized(), True, ""

    monkeypatch.setattr(fp8_convert, "dense_weight", dense)

    def model():
        m = torch.nn.Module()
        m.o_proj = Nf4Linear(1024, 1024)  # big enough to show in GB to 3 decimals
        return m

    for storage, held, other in (("nf4", "fp8_nf4_gb", "fp8_gb"), ("fp8", "fp8_gb", "fp8_nf4_gb")):
        m = model()
        original = m.o_proj
        unit = Unit("frozen", m, {"linear": ("o_proj", fp8_convert.ModuleSlot(m, "o_proj"))}, "modules")
        conv = Conversion(storage=storage).run([unit])
        base = m.o_proj
        assert conv.converted == 1 and isinstance(base, FP8Base)
        assert (base.nf4 is not None) == (storage == "nf4")
        if storage == "nf4":  # the very bytes the 4-bit layer held, not a copy
            assert base.nf4.packed.data_ptr() == original.weight.data_ptr()
        copy = FP8Base.from_weight(original.src.dequantized())
        assert torch.equal(base.fp8_weight().view(torch.uint8), copy.weight.view(torch.uint8))
        sizes = base_bytes(m)
        assert sizes[held] > 0 and sizes[other] == 0


def test_an_nf4_source_refuses_data_that_does_not_cover_its_weight():
    src, _, _ = quantize_nf4(torch.randn(16, 64))
    with pytest.raises(ValueError, match="holds 1024 values, the weight 32x64"):
        NF4Source(src.packed, src.absmax, NF4, 64, (32, 64))
    with pytest.raises(ValueError, match="absmax blocks"):
        NF4Source(src.packed, src.absmax[:4], NF4, 64, (16, 64))


def test_storage_is_a_config_key_auto_by_default_and_contradictions_are_named(tmp_path):
    from jobs.learning.plan import throughput_key as key_of
    from jobs.night.config import NightConfig
    from jobs.night.model import throughput_key

    assert TrainConfig().fp8_storage == "auto"
    cfg = NightConfig.model_validate({"state_dir": tmp_path, "model": {"path": tmp_path}})
    keys = {s: throughput_key(cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8_storage": s})}),
                              "m", "unsloth", "H200") for s in ("auto", "fp8", "nf4")}
    assert len(set(keys.values())) == 3  # a night of one storage never reads another's memory line
    t = cfg.train  # the default's key is the one recorded before the key existed: calibrations made then still count
    before = {"model": "m", "backend": "unsloth", "device": "H200", "rank": t.lora_rank, "targets": t.target_modules,
              "batch_size": t.batch_size, "max_tokens": t.max_tokens_per_batch, "max_seq": t.max_seq_length,
              "grad_ckpt": t.gradient_checkpointing, "4bit": t.quantized_base, "batching": t.batching,
              "tokens_per_step": t.tokens_per_step, "max_vram_gb": cfg.gpu.max_vram_gb}
    assert keys["auto"] == key_of(before)
    with pytest.raises(ValueError, match=r"fp8_storage.*fp8_keep_transposed"):
        TrainConfig(fp8_storage="nf4", fp8_keep_transposed=True)
    with pytest.raises(ValueError, match="fp8_storage"):
        TrainConfig(fp8_storage="int4")


def test_calibrate_names_nf4_storage_only_where_fp8_runs_as_a_copy_of_a_4bit_base():
    from jobs.night.calibrate import nothing_fits
    from jobs.training.fp8.compute import CalibrationDecision

    fp8, bf16 = CalibrationDecision("fp8", None), CalibrationDecision("bf16", None)
    msg = nothing_fits(40.0, TrainConfig(), fp8, "fp8")
    assert "nothing fits under 40.0 GB" in msg and 'fp8_storage = "nf4"' in msg
    for t, d, held in ((TrainConfig(), bf16, None), (TrainConfig(), None, None), (TrainConfig(), fp8, "nf4"),
                       (TrainConfig(method="lora"), fp8, "fp8")):
        assert "fp8_storage" not in nothing_fits(40.0, t, d, held)


def _units(*shapes):
    from jobs.training.fp8 import convert as fp8_convert
    from jobs.training.fp8.convert import Unit

    m = torch.nn.Module()
    names = ["o_proj", "up_proj", "down_proj"][: len(shapes)]  # found by name, as a model's frozen projections are
    for i, (name, (n, k)) in enumerate(zip(names, shapes, strict=True)):
        setattr(m, name, Nf4Linear(n, k) if i % 2 == 0 else torch.nn.Linear(k, n, bias=False).requires_grad_(False))
    return m, [Unit("frozen", m, {"linear": (name, fp8_convert.ModuleSlot(m, name))}, "modules") for name in names]


def test_auto_storage_keeps_nf4_where_the_copy_would_take_a_large_share_of_the_budget():
    from jobs.training.fp8.convert import NF4_WHEN_COPY_OVER, choose_storage

    _, units = _units((1024, 1024), (512, 1024), (1024, 2048))  # NF4: 1,048,576 + 2,097,152 values; one bf16
    copy_gb = 3 * 2**20 / 1e9
    over = copy_gb / NF4_WHEN_COPY_OVER
    held, why = choose_storage("auto", units, keep_transposed=False, cap_gb=over * 0.99)
    assert held == "nf4" and "would take 0.00315 GB, 30% of" in why and "(over 30%)" in why
    held, why = choose_storage("auto", units, keep_transposed=False, cap_gb=over * 1.01)
    assert held == "fp8" and "not over 30%" in why
    assert choose_storage("auto", units, keep_transposed=True, cap_gb=0.001)[0] == "fp8"  # the kept copy is e4m3
    assert choose_storage("auto", units, keep_transposed=False, cap_gb=None) == ("fp8", "auto: the card's memory is "
                                                                                "not known")
    assert choose_storage("auto", units[1:2], keep_transposed=False, cap_gb=0.001) == ("fp8", "auto: no NF4 base")
    for explicit in ("fp8", "nf4"):
        assert choose_storage(explicit, units, keep_transposed=False, cap_gb=None)[0] == explicit
    for u in units:
        u.route = "blocked"  # what stays bf16 costs no copy
    assert choose_storage("auto", units, keep_transposed=False, cap_gb=0.001)[0] == "fp8"


def test_enable_fp8_holds_the_bases_as_auto_decided_and_says_why(monkeypatch):
    from jobs.training.fp8 import convert as fp8_convert
    from jobs.training.fp8.enable import enable_fp8

    monkeypatch.setattr(fp8_convert, "dense_weight", lambda base: (
        (base.src.dequantized(), True, "") if isinstance(base, Nf4Linear) else (base.weight.detach(), False, "")))
    for cap, held in ((0.001, "nf4"), (1000.0, "fp8")):
        m, _ = _units((1024, 1024), (512, 1024))
        out = enable_fp8(m, device="cpu", tokens=[], activations="none", unsloth=False, storage="auto", cap_gb=cap)
        assert out.conversion["storage"] == held and out.conversion["storage_why"].startswith("auto: an e4m3 copy")
        assert out.conversion["converted"] == 2 and (m.o_proj.nf4 is not None) == (held == "nf4")
        assert m.up_proj.nf4 is None  # a bf16 base gets its copy either way


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """The lookup's PTX run instruction by instruction (the integer subset it uses; prmt in its default mode: each
    selector nibble's low 3 bits pick a byte of {b, a}, bit 3 replicates that byte's sign)."""
    mask = 0xFFFFFFFF

    def prmt(a: int, b: int, c: int) -> int:
        src, d = (b << 32) | a, 0
        for i in range(4):
            sel = (c >> (4 * i)) & 0xF
            byte = (src >> (8 * (sel & 7))) & 0xFF
            d |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        return d

    ops = {"mov.b32": lambda a: a, "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & mask,
           "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "not.b32": lambda a: ~a & mask,
           "prmt.b32": prmt}
    regs = dict(regs)
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        dst, *args = (a.strip() for a in rest.split(","))
        regs[dst] = ops[op](*(regs[a] if a in regs else int(a, 0) & mask for a in args))
    return regs


def test_the_kernels_table_lookup_picks_each_nibbles_entry_in_column_order():
    import random

    from jobs.training.fp8.nf4_kernel import LOOKUP_PTX

    rng = random.Random(0)
    for _ in range(3000):
        table = [rng.randrange(256) for _ in range(16)]
        words = [sum(table[4 * w + i] << (8 * i) for i in range(4)) for w in range(4)]
        packed = [rng.randrange(256) for _ in range(4)]  # bytes in memory order: byte j holds values 2j (hi), 2j + 1
        regs = _run_ptx(LOOKUP_PTX, {"$2": sum(b << (8 * i) for i, b in enumerate(packed)),
                                     **{f"${3 + w}": words[w] for w in range(4)}})
        got = [(regs[r] >> (8 * i)) & 0xFF for r in ("$0", "$1") for i in range(4)]
        assert got == [table[v] for b in packed for v in (b >> 4, b & 15)]
