# Sourced on the GPU machine to run fp8mla under another Triton release carried as a bundle
# (../shared/tools/triton-bundle.sh VERSION .triton, plus .triton/ptxas-12.9.xz: the legacy ptxas that release's
# wheel ships and fp8mla compiles sm_90a with; the bundle drops the wheel's binaries):
#   source scripts/triton_bundle_env.sh 3.9.0
ver=${1:?usage: source scripts/triton_bundle_env.sh VERSION}
dir=/tmp/triton-$ver
if [ ! -d "$dir/triton" ]; then
  python3 -c "import tarfile, sys; tarfile.open(f'.triton/triton-{sys.argv[1]}.tar.xz').extractall(sys.argv[2])" "$ver" "$dir"
  mkdir -p "$dir/triton/backends/nvidia/bin"
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open('.triton/ptxas-12.9.xz'), open(sys.argv[1], 'wb'))" \
    "$dir/triton/backends/nvidia/bin/ptxas"
  chmod +x "$dir/triton/backends/nvidia/bin/ptxas"
fi
export PYTHONPATH=$dir:src
export TRITON_PTXAS_PATH=$dir/triton/backends/nvidia/bin/ptxas TRITON_PTXAS_BLACKWELL_PATH=$dir/triton/backends/nvidia/bin/ptxas
export TRITON_CUOBJDUMP_PATH=/usr/local/cuda/bin/cuobjdump TRITON_NVDISASM_PATH=/usr/local/cuda/bin/nvdisasm
python3 -c "import triton; print('triton', triton.__version__, triton.__file__)"
