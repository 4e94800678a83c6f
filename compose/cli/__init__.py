"""The `meshserve` command: its subcommands, `up` / `serve`, and vLLM flag translation."""
