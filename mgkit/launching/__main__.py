"""``python -m mgkit.launching FD_IN FD_OUT``: how ``mg.launch`` starts a rank (see ``_child``)."""

import sys

if __name__ == "__main__":
    from ._child import main

    main(sys.argv)
