def add_arguments(p):
    p.set_defaults(func=lambda a: 0)
