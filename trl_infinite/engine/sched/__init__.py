"""What runs, when, and where its KV lives, described without torch: requests (`sequence`), the batch each step
hands to an executor (`batch`), the scheduler (slots, admission, preemption), KV block accounting and the prefix
cache, slot modes, the ordering / admission policies (`policies/`) and the completion-length predictors
(`predictors/`). Importing this package never imports torch; the simulator runs on it alone."""
