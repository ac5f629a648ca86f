"""lit_rlhf.core is pure torch: it must import with Lightning, transformers, Hydra and W&B blocked."""

import subprocess
import sys

CODE = r"""
import sys, importlib, pkgutil
class Block:
    def find_spec(self, name, path=None, target=None):
        blocked = {'lightning', 'pytorch_lightning', 'transformers', 'hydra', 'omegaconf', 'wandb', 'deepspeed'}
        if name.split('.')[0] in blocked:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import lit_rlhf.core as core
mods = [m.name for m in pkgutil.iter_modules(core.__path__)]
assert mods, 'no core modules found'
for m in mods:
    importlib.import_module('lit_rlhf.core.' + m)
print('ok', len(mods))
"""


def test_core_imports_without_heavy_frameworks():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
