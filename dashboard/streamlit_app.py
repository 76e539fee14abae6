"""The file ``streamlit run`` executes (``tokenprobe dashboard``, the app tests).

Streamlit runs it as a script, outside any package, so this one file imports
the app by its installed name; the app itself (``app``) is an ordinary module.
"""

from tokenprobe.dashboard.app import main

main()
