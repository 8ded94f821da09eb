"""Optional step capabilities, one module or folder each (`train.extension.StepExtension`)."""

# Plugged into the core step through `lightning_mcore_rl.train.extension.StepExtension`; a
# default (dense, no draft) step imports none of them.
