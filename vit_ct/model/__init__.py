"""The network and the weights it loads, without a training framework.

The network (:mod:`~vit_ct.model.network`, timm's ViT with air patches skipping the blocks;
:mod:`~vit_ct.model.stem`, the conv stem), what a checkpoint or shipped weights say about it
(:mod:`~vit_ct.model.hparams`, :mod:`~vit_ct.model.weights_input`: the input contract), and the start weights it can
load (:mod:`~vit_ct.model.weights`: vit-ct checkpoints, timm state dicts and tags, the shipped weights of
:mod:`~vit_ct.model.shipped`). Nothing here imports Lightning: the LightningModule that trains it is
:mod:`vit_ct.task`."""
