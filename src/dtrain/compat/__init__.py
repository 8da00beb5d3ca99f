"""Old APIs on modern PyTorch: ``dtrain.compat.horovod`` (``horovod.torch``) and
``dtrain.compat.apex`` (NVIDIA apex's ``amp`` and ``parallel``). Built only from dtrain's
public API and torch, like a user's script would be."""
