# MoCo v2 R50 (mmpretrain 1.x, stock config) with ActNN's L3 setup: Q-layers from the
# backbone's conv_cfg / norm_cfg, and ACTConvertHook for every other layer (the MLP neck,
# ReLUs, max pool; the momentum encoder too) at level L3.
_base_ = "mmpretrain::mocov2/mocov2_resnet50_8xb32-coslr-200e_in1k.py"

custom_imports = dict(imports=["act_mm"], allow_failed_imports=False)

model = dict(backbone=dict(conv_cfg=dict(type="QConv2d"), norm_cfg=dict(type="QBN")))

custom_hooks = [dict(type="ACTConvertHook", level="L3")]
