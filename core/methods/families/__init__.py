"""One module per PEFT method family, as PEFT keeps its tuners (``peft/tuners/<method>/``); `core.methods.registry`
lists them. Each module holds, for the adapter types it covers:

- ``FORMULAS``: adapter type (as `core.methods.adapter_keys.adapter_type` names it) → its float64 ΔW,
  ``formula(config, module, tensors, weight)`` from the adapter file's tensors and the base weight W (2-d,
  except where the formula says), written out from the method's definition in PEFT, not taken from its layers;
- ``PARAMS``: the parameter names it saves per module in an adapter file (``lora_A.weight``, ``ia3_l``);
  ``SHARED_KEYS``: top-level keys of tensors every module shares → their parameter name in each module;
- ``ADDITIVE``: the layer kinds whose PEFT merge adds the layer's ``get_delta_weight`` to W as it is;
- ``layer_kind(layer, adapter)``: the kind of a loaded PEFT layer holding ``adapter`` when it is this
  family's, else None; and, for a kind not in ``ADDITIVE``, ``peft_delta(layer, adapter, kind, W)`` (its ΔW
  with PEFT's own functions, in the layer's dtype) and ``peft_source(layer, adapter, kind)`` (those
  functions, in words).

The shared helpers they read with are `core.methods.reading`'s.
"""
