"""The compile gate's reading of ptxas reports (scripts/check-sm70, run by CI): it must fail a build
whose attention kernels spill registers or whose wgmma code got a wait inserted by ptxas, and pass
the reports of a healthy build. CPU only: these are ptxas's own report lines."""
import check_sm70


def load_gate():
    return check_sm70


HEALTHY = """ptxas info    : Compiling entry function '_ZN6mla_kv16attention_detail4sm9022attention_wgmma_kernel' for 'sm_90a'
ptxas info    : Function properties for _ZN6mla_kv16attention_detail4sm9022attention_wgmma_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers
"""
SPILL = HEALTHY.replace("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                        "8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads")
INJECTED = HEALTHY + ("ptxas info    : (C7517) warpgroup.wait is injected in around line 8402 by compiler to allow "
                      "use of registers defined by GMMA in function '_ZN6mla_kv16attention_detail4sm90'\n")


def test_gate_passes_a_healthy_report():
    gate = load_gate()
    assert gate.register_problem(HEALTHY, attention=True) == ""
    assert gate.register_problem(HEALTHY, attention=False) == ""


def test_gate_fails_attention_spills_only():
    gate = load_gate()
    assert "register spill" in gate.register_problem(SPILL, attention=True)
    assert gate.register_problem(SPILL, attention=False) == ""  # the write kernels' capped bf16 spill


def test_gate_fails_an_injected_wgmma_wait_anywhere():
    gate = load_gate()
    for attention in (True, False):
        assert "injected wgmma wait" in gate.register_problem(INJECTED, attention=attention)


def test_gate_holds_both_attention_families_to_no_spills():
    gate = load_gate()
    kernels = gate.REPO / "csrc" / "kernels"
    assert gate.is_attention(kernels / "attention" / "attention_sm70.cu")
    assert gate.is_attention(kernels / "expanded" / "expanded_sm70.cu")
    assert not gate.is_attention(kernels / "write" / "write_kv_sm70.cu")
