from jaxrunner.cli import main

main()
