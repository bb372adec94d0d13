"""Other formats in and out: Hugging Face checkpoints (:mod:`.hf`, DeepSeek-V3's names in
:mod:`.hf_deepseek`, the tensor recipes both use in :mod:`.recipes`) and upcycling a dense
checkpoint into an MoE one (:mod:`.upcycle`, :mod:`.upcycle_deepseek`).

Layer: above ``meshfold.parallel`` (a folded load lays the model out as it reads each rank's
slices); imports parallel, models and the layers below, never data, plan, train, dryrun,
testing or cli (``tests/test_layers.py``).
"""
