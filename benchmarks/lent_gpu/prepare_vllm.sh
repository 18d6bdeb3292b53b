#!/bin/bash
# Build, here, vLLM for the lent GPU machine (H100/H200, Python 3.12, torch 2.11.0+cu130, no network)
# as carry folders .dev/v1, .dev/v2 (each under the 64 MiB a device call carries). vLLM 0.25.0 is the
# release that pins the machine's torch (2.11.0) and is built for CUDA 13 like it. Its wheel is 250 MB
# (606 MB unpacked); what an offline Llama with LoRA on a Hopper GPU needs packs to about 70 MB of xz:
#   - dropped from the wheel, each an import vLLM guards or makes only for other models or GPUs:
#     FlashAttention 2 (_vllm_fa2_C, 191 MB: pre-Hopper GPUs; on sm_90 vLLM takes FA3), the MoE
#     kernels (_moe_C_stable_libtorch, 46 MB: import suppressed, the model is dense), vllm-rs (38 MB:
#     the Rust front end of `vllm serve`), third_party/deep_gemm and fmha_sm100 (63 MB: FP8 DeepSeek
#     and Blackwell kernels, found by find_spec, so absent = off), _flashmla_C* and _qutlass_C
#     (MLA and FP4, guarded);
#   - kept: the core ops (_C_stable_libtorch), FlashAttention 3 (_vllm_fa3_C: 153 MB that xz packs to
#     8 MB), the sleep-mode allocator (cumem_allocator), the small .so files and every .py;
#   - the wheels vLLM imports that the machine lacks (about 10 MB, versions as pip resolves
#     vllm==0.25.0); xgrammar and llguidance are stubbed instead (stub_vllm/, why there).
# The import closure was checked on the CPU machine (docs/gpu.md#vllm-on-the-lent-gpu).
#   bash benchmarks/lent_gpu/prepare_vllm.sh            (then the calls in docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VLLM=0.25.0
D=.dev
C=$D/vllm                              # cache: the wheel, its trimmed tarball, the parts
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || grep -qx ".dev/" .gitignore || { echo "add .dev/ to .gitignore first"; exit 1; }
mkdir -p $C
DL="-q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any"
W=$C/vllm-$VLLM-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f $W ] || $PY -m pip download $DL -d $C vllm==$VLLM
T=$C/vllm-$VLLM-trimmed.tar.xz
if [ ! -f $T ]; then
  X=$(mktemp -d)
  (cd $X && unzip -q "$OLDPWD/$W")
  rm -rf $X/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so $X/vllm/_moe_C_stable_libtorch.abi3.so $X/vllm/vllm-rs \
         $X/vllm/third_party/deep_gemm $X/vllm/third_party/fmha_sm100 $X/vllm/_flashmla_C.abi3.so \
         $X/vllm/_flashmla_extension_C.abi3.so $X/vllm/_qutlass_C.abi3.so
  find $X -name __pycache__ -prune -exec rm -rf {} +
  # xz packs the fatbins far better than the wheel's deflate (FA3: 153 MB -> 8 MB); a few minutes here
  tar -C $X -cf - vllm vllm-$VLLM.dist-info | xz -9 -T2 > $T.tmp && mv $T.tmp $T
  rm -rf $X
fi
# vLLM's imports that the machine's image lacks (KINDS.md's package list), at the versions pip
# resolves for vllm==0.25.0 (2026-11-27). typing_extensions and anyio are there but may be older
# than pydantic 2.14 / openai 3 ask for; newer ones are backward compatible.
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing_extensions==4.16.0 anyio==4.16.0 msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1
        cachetools==8.0.2 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1
        openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7"
rm -rf $D/v[0-9]* $C/whl $C/part.* && mkdir -p $C/whl
$PY -m pip download $DL -d $C/whl $WHEELS
sha256sum $T | cut -c1-64 > $C/vllm.sha256
split -b 60M -d -a 1 $T $C/part.
N=$(ls $C/part.* | wc -l)
ls $C/part.* | xargs -n1 basename > $C/parts.txt
# one part per folder; the wheels ride with the last part when they fit under 62 MiB, else alone
for i in $(seq 1 $N); do
  mkdir -p $D/v$i && mv $C/part.$((i - 1)) $D/v$i/ && cp $C/vllm.sha256 $C/parts.txt $D/v$i/
done
WB=$(du -cb $C/whl | tail -1 | cut -f1); LB=$(du -cb $D/v$N | tail -1 | cut -f1)
if [ $((WB + LB)) -lt $((62 * 1024 * 1024)) ]; then L=$D/v$N; else N=$((N + 1)); L=$D/v$N; mkdir -p $L; cp $C/vllm.sha256 $C/parts.txt $L/; fi
mv $C/whl $L/whl
ls -l $T; du -sb $D/v[0-9]* | awk '{printf "%s %.1f MiB\n", $2, $1 / 1048576}'
echo "$N device calls: bash benchmarks/lent_gpu/install_vllm.sh carrying .dev/v1, then .dev/v2, ... back to back"
