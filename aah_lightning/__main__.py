from aah_lightning.cli import main

main()
