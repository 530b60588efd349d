# Faster R-CNN R50-FPN (mmdet 3.x, stock config) with ActNN's L3 setup: Q-layers from the
# backbone's, neck's and box head's conv_cfg / norm_cfg, and ACTConvertHook for every
# other layer (RPN head, box head FCs, ReLUs, max pool) at level L3.
_base_ = "mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py"

custom_imports = dict(imports=["act_mm"], allow_failed_imports=False)

model = dict(
    backbone=dict(conv_cfg=dict(type="QConv2d"), norm_cfg=dict(type="QBN", requires_grad=True)),
    neck=dict(conv_cfg=dict(type="QConv2d")),
    roi_head=dict(bbox_head=dict(conv_cfg=dict(type="QConv2d"))),
)

custom_hooks = [dict(type="ACTConvertHook", level="L3")]
