"""What a name of a flow, module, command or task type may be: a short identifier.

Names become queue names, table keys and Python attribute names, so one rule serves all.
"""

NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
