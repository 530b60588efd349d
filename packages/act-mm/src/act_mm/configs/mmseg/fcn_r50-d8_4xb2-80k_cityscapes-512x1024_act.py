# FCN R50-D8 (mmseg 1.x, stock config) with ActNN's L3 setup: Q-layers from the
# backbone's and heads' conv_cfg / norm_cfg (synchronised batch norm, as the stock config),
# and ACTConvertHook for every other layer at level L3.
_base_ = "mmseg::fcn/fcn_r50-d8_4xb2-80k_cityscapes-512x1024.py"

custom_imports = dict(imports=["act_mm"], allow_failed_imports=False)

norm_cfg = dict(type="QSyncBN", requires_grad=True)
model = dict(
    backbone=dict(conv_cfg=dict(type="QConv2d"), norm_cfg=norm_cfg),
    decode_head=dict(conv_cfg=dict(type="QConv2d"), norm_cfg=norm_cfg),
    auxiliary_head=dict(conv_cfg=dict(type="QConv2d"), norm_cfg=norm_cfg),
)

custom_hooks = [dict(type="ACTConvertHook", level="L3")]
