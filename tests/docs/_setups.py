"""What a docs code block assumes is already there: ``SETUPS[name] = (module, before, after)``.

``module`` runs at the top of the program (imports, classes; on every rank process too, so
anything that must happen once sits under ``if __name__ == "__main__"``); ``before`` and
``after`` run around the block, inside every rank when the block has ``ranks=N``, where
``backend`` is the rank's backend. ``after`` checks that the block did what it says.
"""

from __future__ import annotations

_TORCH = "import torch\nimport torch.nn as nn\n"

_BLOCKS = (
    _TORCH
    + '''
class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    """blocks (and layers: the same list) of Block, an embedding-free toy."""

    def __init__(self, n=3, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.layers = self.blocks
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def init_weights(self):
        torch.manual_seed(0)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.02)


def build_model():
    torch.manual_seed(0)
    return Net()


def batches(rank, n=3):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)
'''
)

_STEP_AFTER = """
x, y = batches(backend.rank)[0]
loss_fn(model(x), y).backward()
assert all(p.grad is not None for p in model.parameters())
"""

_HF_DIR = """
import os
import torch
from transformers import LlamaConfig, LlamaForCausalLM
DIR = "my-llama"
if __name__ == "__main__" and not os.path.exists(DIR):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(DIR)
    try:  # fsdp train --hf-pretrained also wants a tokenizer
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 128)}, unk_token=" "))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ").save_pretrained(DIR)
    except ImportError:
        pass
    with open("corpus.txt", "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 200)
"""

SETUPS: dict[str, tuple[str, str, str]] = {
    # README / guide: tensor parallelism then fully_shard over dp, on a (2, 2) mesh.
    "tp": (
        _BLOCKS
        + "from torch.distributed.device_mesh import init_device_mesh\n"
        + "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, "
        + "parallelize_module\nfrom fsdp_engine import fully_shard\n",
        'dp, tp = 2, 2\nmodel = build_model()\nplan = {"fc": ColwiseParallel(), '
        '"out": RowwiseParallel()}\n',
        _STEP_AFTER,
    ),
    "gpt-tp": (
        "import torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
        "from fsdp import GPT, GPTConfig, fully_shard\nfrom fsdp.models import parallelize\n",
        "dp, tp = 2, 2\ntorch.manual_seed(0)\nmodel = GPT(GPTConfig(vocab_size=64, "
        "n_layers=2, n_heads=4, d_model=32, seq_len=16))\n",
        "idx = torch.randint(0, 64, (2, 16))\nmodel(idx).float().sum().backward()\n",
    ),
    # coming-from: FSDP2 with meta init; FSDP1's wrapper; DeepSpeed's loop.
    "fsdp2": (
        _BLOCKS
        + "from torch.distributed.device_mesh import init_device_mesh\n"
        + "from fsdp_engine import MixedPrecisionPolicy\n",
        'world = backend.world_size\nwith torch.device("meta"):\n    model = Net()\n',
        _STEP_AFTER,
    ),
    "fsdp1": (
        _BLOCKS
        + "import functools\nimport torch.distributed as dist\n"
        + "from torch.distributed.fsdp import ShardingStrategy\n"
        + "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy\n",
        "model = build_model()\n",
        _STEP_AFTER,
    ),
    "deepspeed": (
        _BLOCKS
        + "from types import SimpleNamespace\nfrom fsdp_engine import fully_shard\n\n"
        + "class LM(Net):\n    def forward(self, x):\n"
        + "        return SimpleNamespace(loss=super().forward(x).square().mean())\n",
        "torch.manual_seed(0)\nmodel = LM()\nx = torch.randn(4, 16)\n",
        "assert all(p.grad is None for p in model.parameters())  # zero_grad ran\n",
    ),
    # Package READMEs: a model with blocks, batches and a loss.
    "blocks": (_BLOCKS, "", ""),
    "engine-step": (_BLOCKS + "from fsdp_engine import fully_shard\n", "", ""),
    "memory": (
        "import torch\n",
        # (imported here too: the block imports torch inside the rank's function)
        "import torch\nnumel = 8 * backend.world_size\n"
        "shard = torch.ones(8, dtype=torch.bfloat16)\n",
        "assert mm.stats() is not None\n",
    ),
    # Checkpoints: a sharded model, its optimizer and a step.
    "ckpt": (
        _BLOCKS + "import fsdp_ckpt\nfrom fsdp_engine import fully_shard\n",
        "model = build_model()\nfor b in model.blocks:\n    fully_shard(b, mesh=backend)\n"
        "fully_shard(model, mesh=backend)\nopt = torch.optim.AdamW(model.parameters())\n"
        "x, y = batches(backend.rank)[0]\nloss_fn(model(x), y).backward()\nopt.step()\n"
        "step = 1\n",
        "",
    ),
    # A committed checkpoint at bucket/runs/gpt and ckpt/run (for shell blocks).
    "ckpt-saved": (
        _BLOCKS
        + """
import fsdp_ckpt
from fsdp_comm import launch
from fsdp_engine import fully_shard

def _save(backend):
    model = build_model()
    for b in model.blocks:
        fully_shard(b, mesh=backend)
    fully_shard(model, mesh=backend)
    opt = torch.optim.AdamW(model.parameters())
    for path in ("bucket/runs/gpt", "ckpt/run"):
        fsdp_ckpt.save(path, model, opt, extra={"step": 1})

if __name__ == "__main__":
    launch(_save, 2)
""",
        "",
        "",
    ),
    # Hugging Face: a tiny Llama saved as a save_pretrained directory, DIR, and a corpus.
    "hf-dir": (
        _HF_DIR
        + "import fsdp\nfrom fsdp import fully_shard\n"
        + "from transformers import AutoConfig, AutoModelForCausalLM\n",
        "",
        "assert report.bytes_read > 0\n",
    ),
    # A checkpoint of a Hugging Face GPT-2 written by fsdp train at ckpt/run.
    "hf-ckpt": (
        "import subprocess, sys\n"
        'if __name__ == "__main__":\n'
        '    subprocess.run([sys.executable, "-m", "fsdp", "train", "--hf-config", '
        '"gpt2:n_layer=2,n_embd=64,n_head=4", "--steps", "2", "--save", "ckpt/run", '
        '"--no-progress"], check=True, timeout=150)\n',
        "",
        'import os\nassert os.path.exists("hf-out/config.json")\n',
    ),
    # A live Hugging Face GPT-2, sharded with fully_shard on every rank.
    "hf-live": (
        "import torch\nimport fsdp\nfrom fsdp import fully_shard\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n",
        "torch.manual_seed(0)\nmodel = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, "
        "n_head=4, vocab_size=128, n_positions=32))\nfor block in model.transformer.h:\n"
        "    fully_shard(block, mesh=backend)\nfully_shard(model, mesh=backend)\n",
        'import os\nassert os.path.exists("hf-out/config.json")\n',
    ),
    "profile": (
        _BLOCKS + "from fsdp_engine import fully_shard\n",
        "model = build_model()\nfor b in model.blocks:\n    fully_shard(b, mesh=backend)\n"
        "fully_shard(model, mesh=backend)\nx, y = batches(backend.rank)[0]\n\n"
        "def train_step():\n    loss_fn(model(x), y).backward()\n",
        "",
    ),
    "lightning": (
        "import lightning.pytorch as L\nfrom fsdp.integrations.lightning import FSDPStrategy\n"
        + _BLOCKS,
        "",
        "assert issubclass(Model, L.LightningModule) and trainer.strategy is not None\n",
    ),
}
