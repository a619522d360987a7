"""Completion-length predictors (`EngineConfig.length_predictor`): the interface and built-ins (`base`), a prompt's
own history (`history`), and the online ridge regression of the "prefix" predictor (`ridge`)."""
