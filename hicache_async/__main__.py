import sys

try:
    from .cli import console_main
except KeyboardInterrupt:  # Ctrl-C while it loads: as the command's own interrupt
    print("hicache-async: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(console_main())
