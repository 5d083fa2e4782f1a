#!/usr/bin/env bash
# Rebuilds the bundled SmolLM2 mapper (proxykv_hf/mapper/checkpoints/proxykv-smollm2-135m-instruct) from runs/base, the shared
# mapper after its 105-text fine-tune (docs/training.md, "The bundled SmolLM2 mapper"). CPU, ~1 hour on 2 cores.
set -euo pipefail
proxykv build-data --proxy-kind self --proxy-statistics sum max lookback --crop-len 2048 --stride 1024 \
    --tokens 2048 --seed 710000 --tasks passkey:filler-train --n-per-task 30 --out data/pk-train
proxykv build-data --proxy-kind self --proxy-statistics sum max lookback --crop-len 2048 --stride 1024 \
    --tokens 2048 --seed 600000 --split train --n-per-task 1 --out data/mix-train
proxykv merge-data data/pk-train data/mix-train --out data/pk-ft
proxykv train --data data/pk-ft --out runs/pk-ft --preset small \
    --mapper-config crop_len=512 stride=512 direct_path=true direct_context=4 --batch-size 4 --layers-per-step 6 \
    --warmup-steps 20 --epochs 5 --init-from runs/base --cpu --val-fraction 0.1 --lr 2e-4
mkdir -p runs/pk-ft5 && cp runs/pk-ft/last/model.safetensors runs/pk-ft/proxykv_config.json runs/pk-ft5/
python -c "from proxykv_hf.mapper.hub import *; a, b = load_checkpoint('runs/base'), load_checkpoint('runs/pk-ft5')
w = b.mapper.state_dict()  # the mean of the weights before and after the 5th epoch
a.mapper.load_state_dict({k: (v + w[k]) / 2 if v.is_floating_point() else v for k, v in a.mapper.state_dict().items()})
save_checkpoint(a, 'runs/avg')"
proxykv train --data data/pk-ft --out runs/l59 --preset small \
    --mapper-config crop_len=512 stride=512 direct_path=true direct_context=4 --batch-size 4 --layers-per-step 5 \
    --target-layers 5 6 7 8 9 --warmup-steps 20 --epochs 5 --init-from runs/avg --cpu --val-fraction 0.1 --lr 2e-4
python -c "from proxykv_hf.mapper.hub import *; a, b = load_checkpoint('runs/avg'), load_checkpoint('runs/l59')
save_checkpoint(Checkpoint(mapper=a.mapper, proxy=a.proxy, target=a.target, extra_mappers=[b.mapper],
                           layer_mappers=[int(5 <= l <= 9) for l in range(30)]), 'runs/bundled')"
