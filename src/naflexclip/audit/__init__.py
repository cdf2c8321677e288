"""The accumulation audit: `naflexclip verify` (`verify_command`), the audit it runs (`gradient_audit`), random
NaFlex windows and splits (`random_windows`) and OpenCLIP's per-microbatch rule, the counter-example
(`openclip_rule`)."""
