from asyncflow.cli import main

main()
