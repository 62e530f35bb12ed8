"""M6 mixture of experts: expert-prototyping routing math (``routing``), the DeepSpeed-path layer
(``deepspeed_layer``) and the M6 architecture description (``architecture``)."""
