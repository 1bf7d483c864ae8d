"""``python -m bench.gpu_kernels --compile-only [--arch 90]``: every Triton kernel compiled for
a GPU architecture without a GPU, with its registers, spills and shared memory (the check
that a launch configuration fits, before a GPU is at hand)."""

from __future__ import annotations

import itertools

import torch


def compile_only(arch: int, hidden: int) -> None:
    """Compile every kernel for ``sm_<arch>`` with its launcher's CUDA configuration and print
    registers per thread, spilled bytes and shared memory (Triton's bundled ptxas and
    cuobjdump; no GPU needed). Pointers and strides are marked 16-divisible, as Triton
    specializes them at run time for the engine's tensors."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_activation as act
    from kernels import triton_batch_invariant as bi
    from kernels import triton_decode_reduce as red
    from kernels import triton_int4_linear as int4
    from kernels import triton_kv_store as kv
    from kernels import triton_mla_decode as mla
    from kernels import triton_mla_prefill as mla_pre
    from kernels import triton_moe as moe
    from kernels import triton_paged_decode as dec
    from kernels import triton_prefill_attention as pre
    from kernels import triton_rms_norm as norm
    from kernels import triton_rotary as rot

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    target = GPUTarget("cuda", arch, 32)

    def usage(
        fn, dtype: str, constants: dict, num_warps: int, num_stages: int, kv_ptr: str = ""
    ) -> str:
        """``kv_ptr``: the cache pointer's type when it differs from ``dtype`` (an FP8
        cache is packed uint8 rows)."""
        names = fn.arg_names
        floats = {"scale_log2", "eps", "k_scale", "v_scale"}
        int_pointers = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
        int_pointers |= {"query_start_loc_ptr": "*i32", "slot_mapping_ptr": "*i64"}
        int_pointers |= {"positions_ptr": "*i64", "qweight_ptr": "*i32"}
        int_pointers |= {"sorted_pair_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
        fp32_pointers = {"partial_out_ptr", "partial_lse_ptr", "scales_ptr", "zeros_ptr"}
        fp32_pointers |= {"topk_weights_ptr", "pair_out_ptr"}
        signature = {}
        for name in names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in int_pointers:
                signature[name] = int_pointers[name]
            elif name in fp32_pointers:
                signature[name] = "*fp32"
            elif name in ("kv_ptr", "cache_ptr") and kv_ptr:
                signature[name] = kv_ptr
            elif name.endswith("_ptr"):
                signature[name] = f"*{dtype}"
            else:
                signature[name] = "fp32" if name in floats else "i32"
        aligned = [
            i
            for i, n in enumerate(names)
            if n not in constants and (n.endswith("_ptr") or n.startswith("stride_"))
        ]
        src = ASTSource(
            fn,
            signature,
            constexprs={(names.index(k),): v for k, v in constants.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
        )
        options = {"num_warps": num_warps, "num_stages": num_stages}
        kernel = triton.compile(src, target=target, options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            out = subprocess.run(
                [cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        regs = re.search(r"REG:(\d+)", out).group(1)
        stack = re.search(r"STACK:(\d+)", out).group(1)
        return f"{regs} | {stack} | {kernel.metadata.shared}"

    print(f"sm_{arch}, triton {triton.__version__}; Llama-3-8B shapes (Hq 32, Hkv 8)\n")
    print("| kernel | dtype | config | registers | spilled bytes | shared bytes |")
    print("|---|---|---|---|---|---|")
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        precision = dec.dot_precision(torch_dtype)
        block_n, warps = dec.launch_config(torch_dtype, is_cuda=True)
        # The FP8 cache rows (packed uint8, IS_FP8) only with bf16 queries: Triton's fp8
        # type needs sm_89+, and fp32 models keep an fp32 cache in practice.
        fp8_rows = (False, True) if dtype == "bf16" else (False,)
        for (head_dim, is_split), is_fp8 in itertools.product(
            ((128, False), (128, True), (80, True)), fp8_rows
        ):
            pad = triton.next_power_of_2(head_dim)
            constants = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad)
            constants |= dict(BLOCK_SIZE=16, BLOCK_N=block_n, IS_SPLIT=is_split)
            constants |= dict(DOT_PRECISION=precision, IS_FP8=is_fp8)
            config = f"D={head_dim} split={is_split} BLOCK_N={block_n} warps={warps}"
            config += " fp8-kv" if is_fp8 else ""
            kv_type = "*u8" if is_fp8 else ""
            result = usage(dec._paged_decode_kernel, dtype, constants, warps, 2, kv_type)
            print(f"| decode | {dtype} | {config} | {result} |")
        constants = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=16)
        print(
            f"| decode reduce | {dtype} | 16 splits | {usage(red.decode_reduce_kernel, dtype, constants, 4, 1)} |"
        )
        constants = dict(HEAD_DIM=128, HEAD_DIM_PAD=128)
        ordered = usage(red.decode_reduce_ordered_kernel, dtype, constants, 4, 1)
        print(f"| decode reduce, in order (deterministic) | {dtype} | per sequence | {ordered} |")
        for head_dim, is_fp8 in itertools.product((64, 128, 256), fp8_rows):
            bm, bn, warps, stages = pre.launch_config(torch_dtype, head_dim, is_cuda=True)
            constants = dict(GROUP=4, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16)
            constants |= dict(BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=precision, IS_FP8=is_fp8)
            config = f"D={head_dim} {bm}x{bn} warps={warps} stages={stages}"
            config += " fp8-kv" if is_fp8 else ""
            kv_type = "*u8" if is_fp8 else ""
            result = usage(pre._prefill_attention_kernel, dtype, constants, warps, stages, kv_type)
            print(f"| prefill | {dtype} | {config} | {result} |")
        for is_fp8 in fp8_rows:
            constants = dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128)
            constants |= dict(BLOCK_SIZE=16, IS_FP8=is_fp8, HAS_K_SCALE=False, HAS_V_SCALE=False)
            config = "Hkv=8 D=128" + (" fp8-kv" if is_fp8 else "")
            kv_type = "*u8" if is_fp8 else ""
            result = usage(kv._store_kv_kernel, dtype, constants, 4, 1, kv_type)
            print(f"| store_kv | {dtype} | {config} | {result} |")
        constants = dict(HIDDEN_SIZE=hidden, BLOCK=hidden, HAS_RESIDUAL=True)
        print(
            f"| fused_add_rms_norm | {dtype} | H={hidden} | {usage(norm._rms_norm_kernel, dtype, constants, 16, 1)} |"
        )
        constants = dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, Q_HEADS_PAD=32, K_HEADS_PAD=8)
        constants |= dict(HALF=64, HALF_PAD=64)
        print(
            f"| rotary | {dtype} | Hq=32 Hkv=8 D=128 | {usage(rot._rotary_kernel, dtype, constants, 4, 1)} |"
        )
        constants = dict(BLOCK=1024)
        print(
            f"| silu_and_mul | {dtype} | BLOCK=1024 | {usage(act._silu_and_mul_kernel, dtype, constants, 4, 1)} |"
        )
        for block_m in (16, 64):  # the launcher's tile for decode batches and for prefill
            constants = dict(GROUP_SIZE=128, HAS_BIAS=False, DOT_PRECISION=precision)
            constants |= dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)
            config = f"group 128 {block_m}x64x64"
            result = usage(int4._int4_linear_kernel, dtype, constants, 4, 1)
            print(f"| int4_linear | {dtype} | {config} | {result} |")
        constants = dict(HAS_BIAS=False, DOT_PRECISION=precision, BLOCK_M=bi.BLOCK_M)
        constants |= dict(BLOCK_N=bi.BLOCK_N, BLOCK_K=bi.BLOCK_K)
        config = f"{bi.BLOCK_M}x{bi.BLOCK_N}x{bi.BLOCK_K} (deterministic)"
        result = usage(bi._linear_kernel, dtype, constants, 4, 2)
        print(f"| batch-invariant linear | {dtype} | {config} | {result} |")
        # MoE (Mixtral-8x7B-like, 8 experts): the decode and the prefill tiles. The unit
        # strides (a row's last axis) are constants, as Triton specializes a 1 at run time.
        for num_pairs in (16, 8192):
            cfg = moe.launch_config(num_pairs, 8, torch_dtype, is_cuda=True)
            tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
            config = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} warps={cfg.num_warps}"
            config += f" stages={cfg.num_stages}"
            constants = dict(stride_hk=1, stride_wk=1, TOP_K=2, DOT_PRECISION=precision, **tiles)
            result = usage(moe._moe_gate_up_kernel, dtype, constants, cfg.num_warps, cfg.num_stages)
            print(f"| moe gate_up + silu | {dtype} | {config} | {result} |")
            constants = dict(stride_wk=1, DOT_PRECISION=precision, **tiles)
            result = usage(moe._moe_down_kernel, dtype, constants, cfg.num_warps, cfg.num_stages)
            print(f"| moe down | {dtype} | {config} | {result} |")
        # MLA decode on the latent cache, DeepSeek-V3's shapes (R 512, P 64, 16 heads a program).
        block_n, warps = mla.launch_config(torch_dtype)
        for is_split, is_fp8 in ((False, False), (True, False), (True, True)):
            constants = dict(BLOCK_H=16, RANK=512, RANK_PAD=512, ROPE=64, ROPE_PAD=64)
            constants |= dict(BLOCK_SIZE=16, BLOCK_N=block_n, IS_SPLIT=is_split)
            constants |= dict(DOT_PRECISION=precision, IS_FP8=is_fp8)
            config = f"R=512 P=64 split={is_split} fp8={is_fp8} BLOCK_N={block_n} warps={warps}"
            cache = "*u8" if is_fp8 else ""  # an FP8 latent cache: packed uint8 rows
            result = usage(mla._mla_decode_kernel, dtype, constants, warps, 2, kv_ptr=cache)
            print(f"| mla decode | {dtype} | {config} | {result} |")
        # MLA prefill chunks on the latent cache: (token, head) rows by positions.
        block_m, block_n, warps = mla_pre.launch_config(torch_dtype)
        for is_fp8 in fp8_rows:
            constants = dict(RANK=512, RANK_PAD=512, ROPE=64, ROPE_PAD=64, BLOCK_SIZE=16)
            constants |= dict(BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=precision)
            constants |= dict(IS_FP8=is_fp8)
            config = f"R=512 P=64 fp8={is_fp8} {block_m}x{block_n} warps={warps}"
            cache = "*u8" if is_fp8 else ""
            result = usage(mla_pre._mla_prefill_kernel, dtype, constants, warps, 2, kv_ptr=cache)
            print(f"| mla prefill | {dtype} | {config} | {result} |")
