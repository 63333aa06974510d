"""The checks of lessons 07 on (a language model as a policy, through DPO and TRL): one module per lesson."""
