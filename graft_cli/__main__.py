from graft_cli.cli import main

main()
