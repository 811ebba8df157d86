"""The compile gate's resource check (scripts/check-sm70, run by CI), on CPU: its reader of a cubin's
ELF (registers, static shared memory, local memory and __launch_bounds__ of each kernel, laid out as
ptxas writes them and cuobjdump -elf shows them) and its check of those against each GPU class of a
compiled target. The cubin here is built in the test with the sections ptxas emits."""
import struct

import pytest

import check_sm70 as gate


BOUNDED = "_Z7boundedv"
UNBOUNDED = "_Z9unboundedv"
HELPER = "$__internal_0_$__cuda_sm20_div_s64"  # a device function: not a kernel


def sval(attr, payload):
    return struct.pack("<BBH", gate.EIFMT_SVAL, attr, len(payload)) + payload


def hval(attr, value):
    return struct.pack("<BBH", 0x03, attr, value)


def make_cubin():
    """A cubin with a kernel under __launch_bounds__(128) (48 registers from EIATTR_REGCOUNT, 1,024
    bytes of static shared memory, a 16-byte stack), a kernel without bounds (32 registers from
    sh_info only, 8 bytes of .nv.local), and a device function."""
    names = ["", ".shstrtab", ".strtab", ".symtab", ".nv.info", f".nv.info.{BOUNDED}", f".nv.info.{UNBOUNDED}",
             f".text.{BOUNDED}", f".text.{UNBOUNDED}", f".nv.shared.{BOUNDED}", f".nv.local.{UNBOUNDED}"]
    shstrtab = b"".join(n.encode() + b"\0" for n in names)
    name_offset = {}
    pos = 0
    for n in names:
        name_offset[n] = pos
        pos += len(n) + 1
    sym_names = ["", BOUNDED, UNBOUNDED, HELPER]
    strtab = b"".join(n.encode() + b"\0" for n in sym_names)
    str_offset = [sum(len(m) + 1 for m in sym_names[:i]) for i in range(len(sym_names))]
    text_bounded, text_unbounded = 7, 8  # section indexes
    symtab = b"".join([
        gate.ELF64_SYM.pack(0, 0, 0, 0, 0, 0),
        gate.ELF64_SYM.pack(str_offset[1], 0x12, gate.STO_CUDA_ENTRY, text_bounded, 0, 0x100),  # GLOBAL FUNC
        gate.ELF64_SYM.pack(str_offset[2], 0x02, gate.STO_CUDA_ENTRY, text_unbounded, 0, 0x100),  # LOCAL FUNC
        gate.ELF64_SYM.pack(str_offset[3], 0x22, 0, text_bounded, 0x80, 0x40),  # WEAK FUNC, no ENTRY
    ])
    nv_info = b"".join([
        sval(gate.EIATTR_REGCOUNT, struct.pack("<II", 1, 48)),
        sval(gate.EIATTR_FRAME_SIZE, struct.pack("<II", 1, 16)),
        sval(gate.EIATTR_MIN_STACK_SIZE, struct.pack("<II", 1, 16)),
        sval(gate.EIATTR_FRAME_SIZE, struct.pack("<II", 3, 0)),
        sval(gate.EIATTR_FRAME_SIZE, struct.pack("<II", 2, 0)),  # no REGCOUNT: sh_info says 32
    ])
    info_bounded = b"".join([
        sval(0x37, struct.pack("<I", 0x81)),  # EIATTR_CUDA_API_VERSION
        hval(0x19, 0xC8),  # EIATTR_CBANK_PARAM_SIZE
        hval(0x1B, 0x30),  # EIATTR_MAXREG_COUNT
        sval(gate.EIATTR_MAX_THREADS, struct.pack("<III", 128, 1, 1)),
        sval(0x1E, struct.pack("<I", 0)),  # EIATTR_CRS_STACK_SIZE
    ])
    info_unbounded = sval(0x37, struct.pack("<I", 0x81)) + hval(0x19, 0xC8)
    # (name, type, flags, link, info, data or NOBITS size)
    sections = [
        ("", 0, 0, 0, 0, b""),
        (".shstrtab", 3, 0, 0, 0, shstrtab),
        (".strtab", 3, 0, 0, 0, strtab),
        (".symtab", 2, 0, 2, 1, symtab),
        (".nv.info", 0x70000000, 0, 3, 0, nv_info),
        (f".nv.info.{BOUNDED}", 0x70000000, 0x40, 3, text_bounded, info_bounded),
        (f".nv.info.{UNBOUNDED}", 0x70000000, 0x40, 3, text_unbounded, info_unbounded),
        # sh_info bits 24..31 hold the registers too (they agree in ptxas's cubins); 40 here tells
        # that EIATTR_REGCOUNT's 48 is the one read where both exist.
        (f".text.{BOUNDED}", 1, 6, 3, (40 << 24) | 1, b"\0" * 0x100),
        (f".text.{UNBOUNDED}", 1, 6, 3, (32 << 24) | 2, b"\0" * 0x100),
        (f".nv.shared.{BOUNDED}", 8, 3, 0, text_bounded, 1024),
        (f".nv.local.{UNBOUNDED}", 8, 3, 0, text_unbounded, 8),
    ]
    body = bytearray(b"\0" * 64)
    headers = []
    for name, sh_type, flags, link, info, content in sections:
        offset = len(body)
        if isinstance(content, int):  # NOBITS: a size, no bytes
            size = content
        else:
            body += content
            size = len(content)
        headers.append(gate.ELF64_SHDR.pack(name_offset[name], sh_type, flags, 0, offset, size, link, info, 1, 0))
    shoff = len(body)
    body += b"".join(headers)
    header = bytearray(64)
    header[:8] = b"\x7fELF\x02\x01\x01\x41"
    struct.pack_into("<HHI", header, 16, 2, gate.EM_CUDA, 1)
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<I", header, 48, 80 << 8)
    struct.pack_into("<HHHHHH", header, 0x34, 64, 0, 0, gate.ELF64_SHDR.size, len(sections), 1)
    body[:64] = header
    return bytes(body)


def test_reads_each_kernels_resources_from_the_cubin():
    kernels = {k.name: k for k in gate.cubin_kernels(make_cubin())}
    assert set(kernels) == {BOUNDED, UNBOUNDED}  # the device function is no kernel
    assert kernels[BOUNDED] == gate.KernelResources(BOUNDED, registers=48, static_smem=1024, local=16,
                                                    max_threads=128)
    assert kernels[UNBOUNDED] == gate.KernelResources(UNBOUNDED, registers=32, static_smem=0, local=8,
                                                      max_threads=None)


def test_reads_nv_info_entries_of_both_formats():
    blob = hval(0x1B, 0x30) + sval(gate.EIATTR_MAX_THREADS, struct.pack("<III", 256, 1, 1)) + hval(0x19, 0xC8)
    assert gate.nv_info_attributes(blob) == [(0x1B, b"\x30\x00"), (gate.EIATTR_MAX_THREADS,
                                                                      struct.pack("<III", 256, 1, 1)),
                                             (0x19, b"\xc8\x00")]
    with pytest.raises(gate.CubinError):
        gate.nv_info_attributes(sval(gate.EIATTR_MAX_THREADS, b"\0" * 12)[:10])  # value cut short


def test_rejects_a_file_that_is_no_elf():
    with pytest.raises(gate.CubinError):
        gate.cubin_kernels(b"// PTX\n.version 8.8\n" + b"\0" * 64)


def kernel(registers=48, static_smem=0, max_threads=128):
    return gate.KernelResources("k", registers, static_smem, 0, max_threads)


@pytest.mark.parametrize("arch", sorted(gate.GPU_CLASSES))
def test_passes_kernels_within_every_class(arch):
    within = [kernel(), kernel(registers=255, max_threads=256), kernel(registers=64, max_threads=1024),
              kernel(static_smem=gate.STATIC_SMEM_LIMIT)]
    assert gate.resource_violations(arch, within) == []


@pytest.mark.parametrize("arch", sorted(gate.GPU_CLASSES))
def test_fails_a_kernel_without_launch_bounds(arch):
    (line,) = gate.resource_violations(arch, [kernel(max_threads=None)])
    assert f"sm_{arch}" in line and "max threads per block" in line and "__launch_bounds__" in line
    assert all(c.name in line for c in gate.GPU_CLASSES[arch])


def test_fails_a_full_block_over_the_sms_registers_on_each_class():
    lines = gate.resource_violations(80, [kernel(registers=129, max_threads=512)])  # 136 x 512 = 69,632
    assert len(lines) == len(gate.GPU_CLASSES[80]) == 3
    for line, cls in zip(lines, gate.GPU_CLASSES[80]):
        assert cls.name in line and "registers per SM" in line and "used 69,632, limit 65,536" in line


def test_register_allocation_granularity():
    assert gate.allocated_registers(250, 256) == 65_536  # 256 per thread, as the SM allocates them
    assert gate.allocated_registers(33, 100) == 40 * 128  # 8 per thread, whole warps
    assert gate.resource_violations(90, [kernel(registers=57, max_threads=1024)]) == []  # 64 x 1024
    assert gate.resource_violations(90, [kernel(registers=65, max_threads=1024)])  # 72 x 1024
    # 250 x 260 = 65,000 would fit, but the SM allocates 256 x 288 = 73,728
    (line,) = gate.resource_violations(90, [kernel(registers=250, max_threads=260)])
    assert "registers per SM (250 x 260 threads): used 73,728, limit 65,536" in line


def test_fails_threads_over_the_block_and_the_sm():
    lines = gate.resource_violations(75, [kernel(registers=16, max_threads=2048)])
    assert any("T4 / RTX 20" in line and "threads per block: used 2,048, limit 1,024" in line for line in lines)
    assert any("T4 / RTX 20" in line and "threads per SM: used 2,048, limit 1,024" in line for line in lines)


def test_fails_static_shared_memory_over_48_kb():
    lines = gate.resource_violations(70, [kernel(static_smem=gate.STATIC_SMEM_LIMIT + 16)])
    assert lines == ["resource violation: k  sm_70  V100  static shared memory per block: used 49,168, "
                     "limit 49,152"]


def test_class_table_holds_the_documented_limits():
    by_name = {c.name: c for cs in gate.GPU_CLASSES.values() for c in cs}
    assert by_name["A10 / A40 / RTX 30 (sm_86)"].threads_per_sm == 1_536
    assert by_name["T4 / RTX 20"].smem_per_block_optin == 65_536
    assert by_name["H100 / H200"].smem_per_block_optin == 232_448
    assert [c.name for c in gate.GPU_CLASSES[80]][0] == "A100"


def test_table_shows_the_margins():
    table = gate.resource_table({70: [kernel(registers=200, max_threads=256, static_smem=768), kernel()],
                                 75: [kernel(max_threads=None)]})
    lines = table.splitlines()
    assert lines[0].split()[0] == "arch"
    assert lines[1].split()[:6] == ["sm_70", "2", "200", "768", "B", "0"]
    assert "51,200 / 65,536 (200 x 256, k)" in lines[1]
    assert "1 undeclared" in lines[2]


def test_fails_an_attention_kernel_with_local_memory():
    """The Sm70 / Sm75 quantized attention kernels once kept 208-384 bytes per thread in local memory
    (an outlined lambda under clang): the gate names the kernel and its bytes."""
    spilled = gate.KernelResources("attention_kernel", 230, 0, 384, 256)
    (line,) = gate.local_memory_problems(70, [kernel(), spilled])
    assert "attention_kernel" in line and "sm_70" in line and "384 B" in line
