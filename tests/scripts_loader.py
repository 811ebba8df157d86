"""Imports a file of scripts/ (extensionless ones too) as a module, for the CPU tests of the scripts."""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(file_name: str, module_name: str):
    loader = importlib.machinery.SourceFileLoader(module_name, str(SCRIPTS / file_name))
    spec = importlib.util.spec_from_loader(module_name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it loads
    loader.exec_module(module)
    return module
