"""The trainers users run, context-parallel: transformers' ``Trainer`` (``hf_trainer``:
``RingTrainer`` and ``RingTrainerMixin``) and TRL's SFT and DPO trainers (``trl``)."""


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
