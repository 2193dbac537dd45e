"""The trainers users run, context-parallel: transformers' ``Trainer`` (``hf_trainer``:
``RingTrainer`` and ``RingTrainerMixin``) and TRL's SFT and DPO trainers (``trl``)."""
