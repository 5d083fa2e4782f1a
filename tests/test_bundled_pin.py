"""The bundled SmolLM2 mapper keeps the same entries on a fixed prompt: what it keeps is pinned, layer by layer,
under the uniform and the global budget, so that a refactor of the scorer, the mapper or the checkpoint format cannot
change it unnoticed. The mapper runs in float32 (``mapper_autocast=False``), so that the pin does not depend on
whether the CPU has native bfloat16."""

import hashlib
import json

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import BUNDLED_MAPPER

PROMPT = ("The harbour town woke slowly. Fishing boats came in with the tide, and the baker on Quay Street "
          "opened at six as always. Somewhere in the middle of the morning, the postmistress wrote in her diary: "
          "the code word for the lighthouse is marigold-47. Then the rain came, and the gulls went quiet. "
          "Children ran along the sea wall, the ferry sounded twice, and an old man counted crates by the ") * 3
TOKENS = 274

# per compacted layer, the first 16 hex digits of the SHA-256 of json.dumps([kept positions of KV head h, h=0..2])
UNIFORM = [
    "f8fcdff57692ce94", "fbf486e4434ed2e2", "02f7e679c54c7659", "1f0f99016baa48f3", "afeba33a8c4df0f4",
    "47748f81cf5bf723", "cd2f7dd8850ba7f7", "ca8b5e4c5a424f3e", "a6008ccf535a2810", "f14ebbe0bf8cfe70",
    "c9e19a6660b56f56", "f96a2801e54cd23e", "c8128d2c71e08ed9", "49c3cfa7a0666c5b", "22bceb8b73e6d6f5",
    "be44f200912b5415", "c5805cd701ddca19", "9e1564f0ba5b3bbd", "3928939dcccd43bc", "d44284214db28580",
    "d7fa7111224eca76", "7487267ed84c78c8", "735a06f403dd00b9", "9911bcd6aa209ecc", "22754d9f8de3f162",
    "53b7b1be36d10af5", "4e6d91bb50bd6710", "7e39d1166da41414", "314f79b2e0a1d386", "5f62b2a5766fe5ab",
]
GLOBAL = [
    "ffedea783264cf5f", "14f81663625a6cef", "2bbbc440a4717e23", "997106778ded0c4f", "dcbedd936f07f003",
    "f6657169290b164b", "ed1b24c2c56450cc", "11254b737eb58cb0", "dfd0a33b481c1be9", "65952bd66ecde9c2",
    "cf778c540f6b2540", "4eab59b17ed3436f", "33204a6e96824cf2", "d0aebeab7ad40598", "0922bdb4952cdd2a",
    "21f36cc7305027b3", "9ef692e290a5e188", "fcce837b29874d0d", "26f1aba2cee4abbd", "eb973f4f17e2d9fd",
    "22ee8bcfeb6eca43", "690d8473b74c24d4", "f19c2ea219436329", "3c560e99c7157563", "c630beb260be87c3",
    "042386de2a33d28b", "8aa10c8ff1ff582f", "433cf48402401057", "cb541cb05797ed83", "1bd64aba087e0802",
]
# layer 7 (scored by the checkpoint's second mapper, layer_mappers), KV head 0, under the uniform budget, in full
LAYER_7_HEAD_0 = [
    0, 1, 2, 3, 5, 8, 10, 11, 12, 14, 17, 22, 24, 25, 26, 27, 29, 30, 35, 37, 40, 41, 42, 43, 44, 45, 48, 49,
    51, 54, 55, 57, 58, 62, 63, 67, 69, 73, 76, 77, 81, 82, 86, 89, 90, 96, 101, 102, 104, 105, 108, 115, 117,
    121, 131, 135, 142, 145, 148, 149, 154, 160, 167, 177, 181, 187, 193, 196, 206, 208, 212, 222, 226, 233,
    236, 239, 244, 245, 249, 251, 258, 272, 273
]


def _digests(kept: dict) -> list[str]:
    return [hashlib.sha256(json.dumps([kept[l][0][h].tolist() for h in range(3)]).encode()).hexdigest()[:16]
            for l in sorted(kept)]


@pytest.mark.smollm
@pytest.mark.slow
def test_bundled_mapper_keeps_the_pinned_entries(smollm):
    model, tok = smollm
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == TOKENS
    found = {}
    for budget in ("uniform", "global"):
        cache = ProxyKVCache.from_pretrained(BUNDLED_MAPPER, keep_ratio=0.3, mapper_autocast=False, budget=budget)
        with torch.no_grad():
            model(input_ids=ids, **with_cache(cache), use_cache=True)
        found[budget] = cache.kept_sets()
    assert found["uniform"][7][0][0].tolist() == LAYER_7_HEAD_0
    assert _digests(found["uniform"]) == UNIFORM
    assert _digests(found["global"]) == GLOBAL
