"""``python -m paged_attention check``: verify every kernel on this machine."""
import sys

USAGE = "usage: python -m paged_attention check"


def main(argv: list[str]) -> int:
    if argv != ["check"]:
        print(USAGE, file=sys.stderr)
        return 2
    from paged_attention.check import main as check_main
    return check_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
