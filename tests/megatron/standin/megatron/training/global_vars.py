"""STAND-IN (tests only): the parsed arguments, as Megatron-LM's global_vars keeps them."""
_ARGS = None


def get_args():
    return _ARGS


def set_args(args):
    global _ARGS
    _ARGS = args
