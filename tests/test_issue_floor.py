"""scripts/issue-floor, checked without a GPU or a disassembler: on SASS listings built here in
cuobjdump's and nvdisasm's formats, it must find the tile loop (the shortest loop holding every mma,
not a diverged warp's detour), leave out the block the softmax's vote branch skips, count the rest,
apply the V100 model to the counts, and refuse what it cannot count."""
import struct

import pytest

import issue_floor as FLOOR


NARROW_INT4_N24 = ("_ZN6mla_kv16attention_detail6narrow23attention_narrow_kernelI13__nv_bfloat16NS_14PagedTableRows"
                   "ELNS_8KvFormatE4ELi24ELb0EEEvNS_15AttentionParamsET0_")


class Listing:
    """A kernel's SASS in cuobjdump -sass's layout; labels stand for addresses until rendered."""

    def __init__(self):
        self.lines = []  # (label or None, text with {label} references)

    def add(self, text, label=None, times=1):
        for _ in range(times):
            self.lines.append((label, text))
            label = None
        return self

    def render(self, name):
        address = {label: 16 * i for i, (label, _) in enumerate(self.lines) if label}
        out = [f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
        for i, (_, text) in enumerate(self.lines):
            text = text.format(**{k: f"{v:#x}" for k, v in address.items()})
            out.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000fe20000000f00 */")
        return "\n".join(out) + "\n"


def narrow_like(body_before_vote=40, vote_block=25, after_vote=30, skip=3):
    """prologue, then the tile loop: a wait branching out of line, wgmmas, the vote and its block, a
    short forward skip, more wgmmas, the backward branch; then the out-of-line wait and the epilogue."""
    s = Listing()
    s.add("MOV R1, c[0x0][0x28]").add("S2R R0, SR_TID.X").add("ISETP.GE.AND P0, PT, R0, 0x1, PT")
    s.add("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR18], R8", label="loop")
    s.add("@!P0 BRA {wait}")
    s.add("LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT", times=body_before_vote // 2)
    s.add("HGMMA.64x24x16.F32 R24, R88, gdesc[UR4], R24, gsb0")
    s.add("FMUL R4, R4, R5", times=body_before_vote - body_before_vote // 2 - 1)
    s.add("VOTE.ANY P0, P0").add("BAR.SYNC.DEFER_BLOCKING R162, 0x80").add("@!P0 BRA {after_vote}")
    s.add("FMUL R6, R6, R7", times=vote_block)
    s.add("@P1 BRA {after_skip}", label="after_vote")
    s.add("NOP", times=skip)
    s.add("HGMMA.64x24x16.F32 R24, R88, gdesc[UR8], R24, gsb0", label="after_skip")
    s.add("IMAD R9, R9, 0x2, R10", times=after_vote)
    s.add("@!P0 BRA {loop}")
    s.add("STS [R2], R4", label="epilogue").add("EXIT")
    s.add("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR18], R8", label="wait")
    s.add("@!P0 BRA {wait}")
    s.add("BRA {loop}")  # back into the loop: longer than the loop itself, never chosen
    return s


def test_counts_the_common_path_of_the_tile_loop():
    kernels = FLOOR.parse_sass(narrow_like().render(NARROW_INT4_N24))
    loop = FLOOR.find_tile_loop(kernels[NARROW_INT4_N24])
    # loop: TRYWAIT, BRA, 20 LOP3, HGMMA, 19 FMUL, VOTE, BAR, BRA, 25 FMUL, BRA, 3 NOP, HGMMA, 30 IMAD, BRA
    assert loop.length == 2 + 40 + 3 + 25 + 1 + 3 + 1 + 30 + 1
    assert loop.vote_length == 25
    assert loop.common_path == loop.length - 25
    assert loop.skippable == 3
    assert loop.mix == {"convert/bitwise": 20, "fp32": 19, "integer": 30, "mma": 2, "control": 10}
    assert sum(loop.mix.values()) == loop.common_path


def test_report_floor_and_label():
    text = narrow_like(body_before_vote=60, vote_block=10, after_vote=80).render(NARROW_INT4_N24)
    (row,) = FLOOR.report(FLOOR.parse_sass(text), FLOOR.DEFAULTS[90][1], clock_ghz=2.0)
    assert row["label"] == "int4 N=24"
    assert row["vote_block"] == 10
    assert row["floor_us"] == pytest.approx(row["common_path"] / 2000.0)
    assert row["tile_bytes"] == 64 * 292  # int4: 288 code bytes and the (scale, zero) pair per token
    assert row["memory_floor_us"] == pytest.approx(64 * 292 * 128 / 4230e3)
    assert FLOOR.report(FLOOR.parse_sass(text), "no_such_kernel", 1.78) == []


def test_a_kernel_without_a_vote_counts_its_whole_loop():
    s = Listing()
    s.add("MOV R1, R2").add("HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24", label="loop")
    s.add("FFMA R1, R2, R3, R4", times=7).add("@P0 BRA {loop}").add("EXIT")
    loop = FLOOR.find_tile_loop(FLOOR.parse_sass(s.render("k"))["k"])
    assert (loop.length, loop.vote_length, loop.common_path) == (9, 0, 9)


def test_integer_and_fp8_wgmmas_count_as_wgmmas():
    s = Listing()
    s.add("MOV R1, R2").add("IGMMA.64x24x32.U8.S8 R24, R36, gdesc[UR4], RZ, !UPT, gsb0", label="loop")
    s.add("QGMMA.64x24x32.F32.E4M3.E4M3 R24, R36, gdesc[UR4], R24, gsb0").add("@P0 BRA {loop}")
    loop = FLOOR.find_tile_loop(FLOOR.parse_sass(s.render("k"))["k"])
    assert (loop.length, loop.mix) == (3, {"mma": 2, "control": 1})


def test_the_shortest_loop_holding_every_wgmma_is_chosen():
    s = Listing()
    s.add("MOV R1, R2", label="outer")
    s.add("HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24", label="tile")
    s.add("FADD R1, R2, R3", times=5).add("HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24")
    s.add("@P0 BRA {tile}").add("IADD3 R1, R2, R3, RZ").add("@P1 BRA {outer}").add("EXIT")
    loop = FLOOR.find_tile_loop(FLOOR.parse_sass(s.render("k"))["k"])
    assert loop.length == 8


def test_refuses_what_it_cannot_count():
    no_mma = Listing().add("MOV R1, R2", label="l").add("@P0 BRA {l}").render("k")
    with pytest.raises(FLOOR.LoopError, match="no wgmma"):
        FLOOR.find_tile_loop(FLOOR.parse_sass(no_mma)["k"])
    outside = Listing().add("MOV R1, R2", label="l").add("@P0 BRA {l}").add("HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24")
    with pytest.raises(FLOOR.LoopError, match="no loop holds"):
        FLOOR.find_tile_loop(FLOOR.parse_sass(outside.render("k"))["k"])
    inner = Listing().add("HGMMA.64x64x16.F32 R24, R88, gdesc[UR4], R24", label="l")
    inner.add("MOV R1, R2", label="i").add("@P1 BRA {i}").add("@P0 BRA {l}")
    with pytest.raises(FLOOR.LoopError, match="inner loop"):
        FLOOR.find_tile_loop(FLOOR.parse_sass(inner.render("k"))["k"])


def test_bad_arguments_exit_2():
    for argv in (["--clock-ghz", "0"], ["--kernel", "("], ["--cubin", "a", "--source", "b"], ["--arch", "80"]):
        with pytest.raises(SystemExit) as e:
            FLOOR.main(argv)
        assert e.value.code == 2


SM70_INT8 = "_ZN6mla_kv16attention_detail16attention_kernelINS_4arch4Sm70E6__halfLi1ENS_14PagedTableRowsELNS_8KvFormatE3EEEvNS_15AttentionParamsET2_"
SM70_16BIT = SM70_INT8.replace("KvFormatE3E", "KvFormatE0E")


def nvdisasm_listing(name, lines):
    """nvdisasm -c's layout: a section header, label lines, and branch operands naming labels."""
    out = [f"//--------------------- .text.{name} --------------------------", f"\t.section\t.text.{name},\"ax\",@progbits"]
    address = 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
            continue
        out.append(f"        /*{address:04x}*/                   {line} ;")
        address += 16
    return "\n".join(out) + "\n"


def sm70_like(name, body):
    """clang's sm_70 shape: the loop entered at the tile's dequantization with a uniform back edge
    (BRA.U), and a diverged warp's shuffle detour (BRA.DIV) that jumps back into the loop's middle:
    a shorter backward branch holding every HMMA, which is no tile loop."""
    return nvdisasm_listing(name, [
        "MOV R1, c[0x0][0x28]",
        ".L_x_0:", *body,
        "BRA.DIV `(.L_x_2)",
        ".L_x_1:", "SHFL.IDX PT, R3, R4, R5, R6", "HMMA.884.F32.F32.STEP0 R8, R10.ROW, R12.COL, R8",
        "HMMA.884.F32.F32.STEP1 R10, R10.ROW, R12.COL, R10", "@P0 BRA `(.L_x_3)",
        "VOTE.ANY R7, PT, PT", "BRA.U `(.L_x_0)",
        ".L_x_3:", "EXIT",
        ".L_x_2:", "WARPSYNC 0xffffffff", "SHFL.IDX PT, R3, R4, R5, R6", "BRA `(.L_x_1)",
    ])


def test_nvdisasm_labels_become_addresses_and_guards_are_kept():
    kernels = FLOOR.parse_nvdisasm(sm70_like("k", ["FMUL R1, R2, R3"]))
    ins = kernels["k"]
    assert [x.opcode for x in ins][:3] == ["MOV", "FMUL", "BRA"]
    assert ins[2].branch_target() == ins[-3].address  # BRA.DIV -> .L_x_2 (WARPSYNC)
    assert ins[-1].branch_target() == ins[3].address  # the detour's return -> .L_x_1 (SHFL)
    assert ins[6].guard == "@P0" and ins[6].branch_target() == ins[9].address


def test_a_diverged_warps_detour_is_no_tile_loop():
    body = ["LDG.E.64.SYS R20, [R2]", "F2F.F16.F32 R4, R5", "STS.128 [R6], R20"] * 2
    ins = FLOOR.parse_nvdisasm(sm70_like("k", body))["k"]
    loop = FLOOR.find_tile_loop(ins, vote=False)
    # .L_x_0 .. BRA.U (13 instructions), not the shorter .L_x_1 .. the detour's BRA (10)
    assert (loop.first, loop.last) == (1, 13)


def test_v100_model_counts_each_pipe():
    body = ["LDS.U.128 R20, [R2]"] * 10 + ["STS [R6], R20"] * 5 + ["LDG.E.64.SYS R20, [R2]"] * 3 + \
           ["F2F.F16.F32 R4, R5"] * 6 + ["IMAD R1, R2, R3, R4"] * 20
    ins = FLOOR.parse_nvdisasm(sm70_like(SM70_INT8, body))[SM70_INT8]
    loop = FLOOR.find_tile_loop(ins, vote=False)
    m = FLOOR.v100_model(ins, loop, clock_ghz=1.0, row_bytes=580)
    assert m["instructions"] == len(body) + 7  # BRA.DIV, SHFL, 2 HMMA, BRA, VOTE, BRA.U
    assert m["mio_units"] == 10 * 4 + 5 * 1 + 3 * 2
    assert (m["hmma_steps"], m["f2f"]) == (2, 6)
    cycles = {"issue": 2 * m["instructions"], "mio": 8 * m["mio_units"], "hmma": 2 * 2 * 2, "f2f": 2 * 8 * 6}
    for pipe, c in cycles.items():
        assert m["us"][pipe] == pytest.approx(c / 1e3)
    assert m["us"]["memory"] == pytest.approx(32 * 580 * 64 / 900e3)
    assert m["binding"] == max(m["us"], key=m["us"].get) and m["tile_us"] == max(m["us"].values())
    assert m["gbs"] == pytest.approx(32 * 580 * 64 / (m["tile_us"] * 1e3))


def test_v100_report_labels_and_ratio_to_the_16_bit_kernel():
    text = sm70_like(SM70_16BIT, ["LDS.U.128 R20, [R2]"] * 40) + sm70_like(SM70_INT8, ["F2F.F16.F32 R4, R5"] * 200)
    rows = FLOOR.report_v100(FLOOR.parse_nvdisasm(text), FLOOR.DEFAULTS[70][1], 1.53)
    labels = [r["label"] for r in rows]
    assert labels == ["16-bit, 32-row CTA", "int8, 32-row CTA"]
    base, int8 = rows
    assert base["vs_16bit"] == pytest.approx(1.0)
    assert int8["vs_16bit"] == pytest.approx(base["tile_us"] / int8["tile_us"])
    assert int8["binding"] == "f2f"
    with pytest.raises(FLOOR.LoopError, match="not an Sm70 attention kernel"):
        FLOOR.report_v100(FLOOR.parse_nvdisasm(sm70_like("combine_kernel", ["MOV R1, R2"])), "combine", 1.53)


def e4m3_decode(fallback_lines, label):
    """dequant.cuh's fp8_values_soft as clang lays it out: the NaN / scale check, a guarded branch over
    the per-value fallback (FSEL of +QNAN), which leaves by an unguarded branch past the common path."""
    return ["LOP3.LUT P0, RZ, R85, 0x80808080, R84, 0xc8, !PT", f"@!P0 BRA `(.L_x_{label}1)",
            *fallback_lines, f"BRA `(.L_x_{label}2)",
            f".L_x_{label}1:", "SHF.R.S32.HI R87, RZ, 0x4, R30", "LOP3.LUT R30, R87, 0x87f00000, RZ, 0xc0, !PT",
            "FMUL R30, R19, R30", f".L_x_{label}2:", "F2F.F16.F32 R30, R30"]


def test_v100_model_leaves_out_the_e4m3_fallback_but_not_a_block_around_it():
    fallback = ["ISETP.NE.AND P5, PT, R84, 0x7f, PT", "FSEL R85, R85, +QNAN , P5", "FMUL R85, R85, c[0x0][0x244]"]
    body = e4m3_decode(fallback, 10) + e4m3_decode(fallback, 20) + ["STS.128 [R20], R84"]
    ins = FLOOR.parse_nvdisasm(sm70_like(SM70_INT8.replace("KvFormatE3E", "KvFormatE1E"), body))
    loop = FLOOR.find_tile_loop(next(iter(ins.values())), vote=False)
    assert loop.fallback_length == 2 * (len(fallback) + 1)  # each with its closing branch
    assert loop.common_path == loop.length - 2 * (len(fallback) + 1)
    assert loop.mix["fp32"] == 2  # the two common-path FMULs, no FSEL
    # a branch over more than the fallback (here: a block holding a whole decode) is not left out
    outer = ["@P1 BRA `(.L_x_9)", *e4m3_decode(fallback, 30), "BRA `(.L_x_8)", ".L_x_9:", "MOV R1, R2", ".L_x_8:"]
    ins = FLOOR.parse_nvdisasm(sm70_like(SM70_16BIT, outer))
    loop = FLOOR.find_tile_loop(next(iter(ins.values())), vote=False)
    assert loop.fallback_length == len(fallback) + 1
    # without the NaN select it is an ordinary branch: counted
    plain = e4m3_decode(["FMUL R85, R85, c[0x0][0x244]"], 40)
    loop = FLOOR.find_tile_loop(next(iter(FLOOR.parse_nvdisasm(sm70_like(SM70_16BIT, plain)).values())), vote=False)
    assert loop.fallback_length == 0


@pytest.mark.parametrize("abi, shift", [(0x41, 8), (0x33, 0)])
def test_sm70_cubin_is_relabelled_sm75_for_the_decoder(tmp_path, abi, shift):
    gate = FLOOR.load_check_sm70()
    header = bytearray(64)
    header[:5], header[7] = b"\x7fELF\x02", abi
    struct.pack_into("<H", header, 18, gate.EM_CUDA)
    cubin = tmp_path / "k.cubin"

    def relabelled(arch):
        struct.pack_into("<I", header, 48, (0x123400 & ~(0xFF << shift)) | (arch << shift))
        cubin.write_bytes(bytes(header))
        return FLOOR.as_sm75(cubin, gate)

    (flags,) = struct.unpack_from("<I", relabelled(70), 48)
    assert (flags >> shift) & 0xFF == 75
    assert flags & ~(0xFF << shift) == 0x123400 & ~(0xFF << shift)
    with pytest.raises(FLOOR.LoopError, match="sm_80"):
        relabelled(80)
    cubin.write_bytes(b"not an ELF")
    with pytest.raises(FLOOR.LoopError, match="no cubin"):
        FLOOR.as_sm75(cubin, gate)
