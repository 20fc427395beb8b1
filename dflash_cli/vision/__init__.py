"""Images for vision-language targets: into prompts, and into each call's feeds."""
